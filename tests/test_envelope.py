"""Envelope construction at the edge (events/envelope.py): ULIDs that sort in creation order, and make_event."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from rolledger.events.envelope import crockford26, make_event, new_event_id
from rolledger.schemas import events as ev
from rolledger.schemas.statuses import AdmissionReason

CROCKFORD = set("0123456789ABCDEFGHJKMNPQRSTVWXYZ")


def test_ids_are_ulids_that_sort_in_creation_order_even_within_one_millisecond() -> None:
    ids = [new_event_id(now_ms=1_700_000_000_000) for _ in range(50)] + [new_event_id() for _ in range(50)]
    assert all(len(i) == 26 and set(i) <= CROCKFORD for i in ids)
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    later = new_event_id(now_ms=int(time.time() * 1000) + 60_000)
    assert later > ids[-1] and later[:10] > ids[-1][:10]  # the first 10 characters are the milliseconds


@given(st.integers(min_value=0, max_value=(1 << 128) - 1))
def test_crockford26_is_the_digit_by_digit_encoding(value: int) -> None:
    """The ULID text: 26 digits of 5 bits, most significant first, in Crockford's alphabet."""
    expected = "".join("0123456789ABCDEFGHJKMNPQRSTVWXYZ"[(value >> (5 * i)) & 31] for i in range(25, -1, -1))
    assert crockford26(value) == expected


def test_make_event_stamps_the_schema_version_a_fresh_id_and_the_wall_time() -> None:
    before = time.time()
    e = make_event(ev.AdmissionPaused(reason=AdmissionReason.LAG, lag=2), run_id="r", producer="p", policy_version=3)
    assert e.schema_version == ev.AdmissionPaused.SCHEMA_VERSION and e.policy_version == 3 and e.run_id == "r"
    assert before <= e.wall_time <= time.time() and len(e.event_id) == 26
    given = make_event(
        ev.AdmissionPaused(reason=AdmissionReason.LAG, lag=2),
        run_id="r",
        producer="p",
        policy_version=0,
        wall_time=5.0,
        event_id="x",
    )
    assert (given.wall_time, given.event_id) == (5.0, "x")
