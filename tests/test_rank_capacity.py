"""The rank's capacity decision (`workflows.rank.may_take`): in groups (the default, what every run before
`rank_capacity` decided: a free slot and the KV worst case) or in sequences (the engine's running-sequence limit,
as vLLM's max_num_seqs, and the unfinished sequences' KV worst case). Pure: no Redis, no engine."""

from __future__ import annotations

import pytest

from rolledger.schemas.config import RunConfig
from rolledger.workflows.rank import RankLoad, may_take, seq_limit


def cfg(**over: object) -> RunConfig:
    return RunConfig.model_validate({"group_size": 8, "rank_slots": 8, **over})


def test_groups_capacity_is_the_old_rule_a_free_slot_and_the_kv_worst_case() -> None:
    c = cfg()
    assert c.rank_capacity == "groups"  # old configs (no field) keep the old decisions
    # the sequences running never matter in groups: only the KV worst case beside the running groups
    assert may_take(c, RankLoad(groups=3, sequences=1000, kv_reserved=100), 8, 50, 200)
    assert not may_take(c, RankLoad(groups=3, sequences=3, kv_reserved=160), 8, 50, 200)
    assert may_take(c, RankLoad(), 8, 10_000, 200)  # nothing runs: a group too big for the budget runs alone


@pytest.mark.parametrize(
    ("load", "room"),
    [
        (RankLoad(groups=3, sequences=24, kv_reserved=0), True),  # 24 + 8 = 32: fits exactly
        (RankLoad(groups=4, sequences=25, kv_reserved=0), False),  # 33 > 32
        (RankLoad(groups=4, sequences=4, kv_reserved=0), True),  # four stragglers hold 4 sequences, not 4 slots
        (RankLoad(groups=8, sequences=8, kv_reserved=0), False),  # rank_slots groups in flight: no thread left
        (RankLoad(groups=2, sequences=2, kv_reserved=195), False),  # the unfinished sequences' KV worst case
    ],
)
def test_sequences_capacity_counts_the_sequences_still_generating(load: RankLoad, room: bool) -> None:
    c = cfg(rank_capacity="sequences", rank_max_seqs=32)
    assert may_take(c, load, 8, 10, 200) is room


def test_the_sequence_limit_comes_from_the_config() -> None:
    assert seq_limit(cfg(rank_max_seqs=32)) == 32
    assert seq_limit(cfg(engine="simulated", simulated={"max_num_seqs": 24})) == 24  # the simulated engine's own
    assert seq_limit(cfg(engine="torch", simulated={"max_num_seqs": 24})) is None  # not this engine's
    unbounded = cfg(rank_capacity="sequences")
    assert seq_limit(unbounded) is None
    assert may_take(unbounded, RankLoad(groups=7, sequences=500), 8, 0, float("inf"))
    assert not may_take(unbounded, RankLoad(groups=8, sequences=8), 8, 0, float("inf"))
