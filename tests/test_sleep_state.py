"""The per-tag sleep state every engine keeps (workers/engines/sleep_state.py): the legal colocated cycle, each
illegal order refused naming the order, and the committed colocated run log (tests/fixtures/colocated) obeying the
same rules rank by rank, so the reducer's view of a rank (EngineSlept, EngineWoke with its tags) and the engine's
own state agree on when an update may be prepared, committed and probed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rolledger.events.codec import decode
from rolledger.schemas import events as ev
from rolledger.workers.engines.protocol import IllegalEngineOrder
from rolledger.workers.engines.sleep_state import ORDER, SleepState

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import history  # tests/fixtures is not a package: it holds data and the scripts that make it


@pytest.mark.parametrize("level", [1, 2])
def test_the_legal_cycle(level: int) -> None:
    s = SleepState().slept(level, rank=0)
    assert (s.asleep_level, s.weights_awake, s.kv_awake, s.serving) == (level, False, False, False)
    s, woken = s.woken(["weights"], rank=0)
    assert woken == ("weights",) and s.weights_awake and not s.kv_awake and s.asleep_level == level
    s.check_weights_awake("prepare v1", rank=0)  # weights awake, KV asleep: an update may be made
    s = s.committed()
    s, woken = s.woken(["weights", "kv_cache"], rank=0)
    assert woken == ("kv_cache",)  # weights already awake: only what sleeps is woken
    assert s == SleepState() and s.serving
    s.check_serving("generate", rank=0)


def test_every_illegal_order_is_refused_naming_the_order() -> None:
    asleep = SleepState().slept(1, rank=3)
    with pytest.raises(IllegalEngineOrder, match=r"rank 3: never update weights while asleep \(prepare v2") as e:
        asleep.check_weights_awake("prepare v2", rank=3)
    assert ORDER in str(e.value)
    with pytest.raises(IllegalEngineOrder, match="kv_cache before weights"):
        asleep.woken(["kv_cache"], rank=3)
    with pytest.raises(IllegalEngineOrder, match="already asleep"):
        asleep.slept(2, rank=3)
    half, _ = asleep.woken(["weights"], rank=3)
    with pytest.raises(IllegalEngineOrder, match=r"generate refused while asleep .*wake\(\['kv_cache'\]\) first"):
        half.check_serving("generate", rank=3)
    with pytest.raises(IllegalEngineOrder, match="already asleep"):
        half.slept(1, rank=3)
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
        SleepState().slept(3, rank=0)
    with pytest.raises(ValueError, match="wake tags"):
        asleep.woken([], rank=0)
    with pytest.raises(ValueError, match="wake tags"):
        asleep.woken(["cuda_graph"], rank=0)


def test_a_level_2_wake_serves_nothing_until_a_commit() -> None:
    s, _ = SleepState().slept(2, rank=0).woken(["weights", "kv_cache"], rank=0)
    assert s.asleep_level == 0 and not s.serving
    with pytest.raises(IllegalEngineOrder, match="before new weights were committed after a level-2 sleep"):
        s.check_serving("generate", rank=0)
    assert s.committed().serving
    s1, _ = SleepState().slept(1, rank=0).woken(["weights", "kv_cache"], rank=0)
    assert s1.serving  # level 1 backed the weights up: they serve again


def test_the_committed_colocated_log_obeys_the_engine_rules_rank_by_rank() -> None:
    """Fold the colocated fixture's engine events through SleepState: every RankPrepared and RankCommitted came
    while that rank's weights were awake, every HealthPassed while it was serving; and it did sleep and wake by tag."""
    _run_id, entries = history.load_entries("colocated")
    events = [decode(raw) for _sid, raw in entries]
    states: dict[int, SleepState] = {}
    checked = {"prepared": 0, "committed": 0, "partial": 0}
    for e in events:
        p = e.payload
        if isinstance(p, ev.RankJoined):
            states[p.rank] = SleepState()
        elif isinstance(p, ev.EngineSlept):
            states[p.rank] = states[p.rank].slept(p.level, p.rank)
        elif isinstance(p, ev.EngineWoke):
            states[p.rank], _ = states[p.rank].woken([str(t) for t in p.tags], p.rank)
            checked["partial"] += bool(states[p.rank].asleep)
        elif isinstance(p, ev.RankPrepared):
            states[p.rank].check_weights_awake(f"prepare v{p.version}", p.rank)
            checked["prepared"] += 1
        elif isinstance(p, ev.RankCommitted):
            states[p.rank].check_weights_awake(f"commit v{p.version}", p.rank)
            states[p.rank] = states[p.rank].committed()
            checked["committed"] += 1
        elif isinstance(p, ev.HealthPassed):
            states[p.rank].check_serving(f"health v{p.version}", p.rank)
    assert min(checked.values()) > 0, checked  # the log has updates made with the KV cache still asleep
