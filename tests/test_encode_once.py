"""A SampleFinished is encoded once (issue 37): the positional bytes `events.measured.measure` makes of a trajectory to count
its `nbytes` are the bytes the codec writes for it in the event, so an append does not encode the trajectory again.
The entry must be byte for byte the one a full encode gives, for any trajectory."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from test_encoded_size import trajectories

from rolledger.events import measured
from rolledger.events.codec import decode, encode
from rolledger.events.envelope import make_event
from rolledger.events.measured import encoded_form, measure
from rolledger.schemas import events as ev
from rolledger.schemas.config import SamplingParams
from rolledger.schemas.trajectory import Trajectory
from rolledger.schemas.wire import enc_hook, encoded_size


def finished(t: Trajectory, nbytes: int | None = None) -> ev.Event:
    payload = ev.SampleFinished(trajectory=t, answer="42", gen_ms=12.5, nbytes=nbytes)
    return make_event(payload, run_id="r", producer="rank-0-rollout-0", policy_version=3)


@settings(max_examples=200, deadline=None)
@given(trajectories())
def test_a_measured_trajectory_is_written_from_its_measure_byte_for_byte(t: Trajectory) -> None:
    assert encoded_form(t) is None  # never measured
    event = finished(t, nbytes=measure(t))
    assert t in measured._measured  # measured: the encode below takes the trajectory's bytes from there
    written = encode(event)  # from the measure
    assert encoded_form(t) is None  # the encode took the measured bytes
    assert written == encode(event)  # a full encode (a retried append: nothing measured any more) is the same
    assert decode(written) == event


def small(i: int = 0, tokens: int = 2) -> Trajectory:
    return Trajectory(
        trajectory_id=f"g1/{i}",
        group_id="g1",
        prompt_id="p",
        index=i,
        prompt_token_ids=[1, 2, 3],
        token_ids=[7] * tokens,
        loss_mask=[1] * tokens,
        positions=list(range(3, 3 + tokens)),
        logprobs=[-0.5] * tokens,
        logprob_mode="raw",
        finish_reason="stop",
        sampling=SamplingParams(max_tokens=8),
        policy_version=1,
        weights_digest="d",
        rank=0,
        engine="e",
        cache_generation=0,
        graph_generation=0,
    )


def test_only_that_very_trajectory_uses_the_measure() -> None:
    t = small()
    equal = msgspec.structs.replace(t)  # equal, another object
    assert equal == t and equal is not t
    measure(t)
    assert encoded_form(equal) is None  # keyed by identity: the copy was never measured
    assert encoded_form(t) == msgspec.msgpack.encode(t, enc_hook=enc_hook)
    assert encoded_form(t) is None  # taken once


def test_measures_nobody_writes_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """An audit measures every trajectory of a log and writes none: what stays is the newest few, by count and
    by bytes."""
    monkeypatch.setattr(measured, "ENCODED_KEPT", 5)
    kept = [small(i) for i in range(20)]  # held here: ids stay unique
    for t in kept:
        measure(t)
    assert len(measured._measured) == 5 and all(t in measured._measured for t in kept[-5:])
    one = len(msgspec.msgpack.encode(small(0, tokens=1000), enc_hook=enc_hook))
    monkeypatch.setattr(measured, "ENCODED_KEPT_BYTES", 3 * one)
    large = [small(i, tokens=1000) for i in range(6)]
    for t in large:
        measure(t)
    assert len(measured._measured) == 3 and all(t in measured._measured for t in large[-3:])
    for t in [*kept, *large]:
        encoded_form(t)
    assert len(measured._measured) == 0


def test_the_pure_size_keeps_nothing() -> None:
    """The audit's and admission's `encoded_size` is a pure function: it leaves nothing in the cache the codec reads."""
    t = small(99)
    assert encoded_size(t) == measure(small(99))
    assert encoded_form(t) is None and t not in measured._measured
