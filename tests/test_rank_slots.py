"""Many groups in flight per rank (`rank_slots`): a rank's rollout slots generate several groups at once, and a rank
killed with several of them in flight loses nothing and counts nothing twice. A real redis-server, the real torch
engine, and for the kill real `rolledger worker rank` processes."""

from __future__ import annotations

import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from audit_check import audited_clean, audited_log
from test_heartbeats import Run
from test_run_loop import execute, small
from test_worker_kill import TERMINAL, _sample_id, _wait_for, _worker

from rolledger.schemas import events as ev
from rolledger.workflows.audit_report import WarningKind

pytestmark = pytest.mark.slow
SLOTS = 4


def _rank_of(p: ev.Payload) -> int | None:
    """The rank a sample event names (SampleCancelled names none)."""
    if isinstance(p, ev.SampleStarted | ev.SampleFailed):
        return p.rank
    if isinstance(p, ev.SampleFinished):
        return p.trajectory.rank
    return None


def _group_of(p: ev.Payload) -> str:
    if isinstance(p, ev.SampleFinished):
        return p.trajectory.group_id
    assert isinstance(p, ev.SampleStarted | ev.SampleFailed | ev.SampleCancelled), p
    return p.group_id


def running_at_once(events: list[ev.Event]) -> dict[int, int]:
    """Per rank, the most groups it was running at once, from the log alone: a group runs on a rank from its first
    SampleStarted there to its last terminal sample event (in log order)."""
    spans: dict[tuple[int, str], list[int]] = {}
    owner: dict[str, int] = {}  # group -> the rank its samples started on
    for at, e in enumerate(events):
        p = e.payload
        if isinstance(p, ev.SampleStarted):
            owner.setdefault(p.group_id, p.rank)
            spans.setdefault((p.rank, p.group_id), [at, at])
        elif isinstance(p, TERMINAL) and getattr(p, "stage", "rollout") == "rollout":
            rank = _rank_of(p)
            key = (owner.get(_group_of(p), -1) if rank is None else rank, _group_of(p))
            if key in spans:
                spans[key][1] = at
    most: Counter[int] = Counter()
    for (rank, _), (start, _end) in spans.items():
        inside = sum(1 for (r, _g), (s, e) in spans.items() if r == rank and s <= start <= e)
        most[rank] = max(most[rank], inside)
    return dict(most)


def ended_once(events: list[ev.Event]) -> Counter[str]:
    """Terminal rollout events per sample: every started sample must have exactly one."""
    started = {e.payload.sample_id for e in events if isinstance(e.payload, ev.SampleStarted)}
    ended = Counter(
        _sample_id(e.payload)
        for e in events
        if isinstance(e.payload, TERMINAL) and getattr(e.payload, "stage", "rollout") == "rollout"
    )
    assert started <= set(ended), sorted(started - set(ended))[:5]  # nothing started is left open
    assert all(c == 1 for c in ended.values()), ended.most_common(3)  # and nothing ends twice
    return ended


def test_a_rank_with_four_slots_runs_several_groups_at_once_and_audits_clean(
    redis_url: str, run_id: str, tmp_path: Path
) -> None:
    cfg = small(ranks=1, rank_slots=SLOTS, steps=2, trainer={"warm_start_steps": 20, "groups_per_step": SLOTS})
    events, summary = execute(redis_url, run_id, tmp_path, cfg)
    assert summary.status == "completed" and summary.steps == 2
    _, report = audited_log(redis_url, run_id)
    ended_once(events)
    assert running_at_once(events)[0] > 1  # one rank, several groups between their SampleStarted and last end
    # each slot appends as a producer of its own, so no producer's ids go backwards although the slots interleave
    slots = {e.producer for e in events if isinstance(e.payload, ev.SampleStarted)}
    assert slots <= {f"rank-0/s{k}" for k in range(SLOTS)} and len(slots) > 1, slots
    assert [w.message for w in report.warnings if w.kind is WarningKind.OUT_OF_ORDER] == []


def test_a_killed_slot_is_replaced_and_its_group_is_closed_once(redis_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = small(
        ranks=1,
        rank_slots=SLOTS,
        steps=2,
        trainer={"warm_start_steps": 20, "groups_per_step": SLOTS},
        recovery={"heartbeat_s": 0.3, "lost_after_s": 1.5},
    )
    events, summary = execute(redis_url, run_id, tmp_path, cfg, "kill-worker=rollout@2")
    assert summary.status == "completed"  # the one rank's killed slot was replaced and the run went on
    audited_log(redis_url, run_id)
    ended_once(events)
    lost = [e.payload for e in events if isinstance(e.payload, ev.SampleFailed)]
    assert len({p.group_id for p in lost}) == 1 and all("worker lost" in p.error for p in lost)  # the killed group
    assert running_at_once(events)[0] > 1


def test_a_sigkilled_rank_with_several_groups_in_flight_loses_nothing_and_counts_nothing_twice(
    redis_url: str, run_id: str, tmp_path: Path
) -> None:
    groups = 3 * SLOTS
    run = Run(redis_url, run_id, tmp_path, groups=groups, rank_slots=SLOTS, max_tokens=24)
    a = _worker(redis_url, run_id, 0, "A", tmp_path / "a.log")
    try:
        # kill A once it has several groups in flight: each holds a pending entry of one of its slots. A is stopped
        # (SIGSTOP) before the log is read, so no group of it can end between that reading and the kill; if one
        # ended before the stop, A goes on and the wait starts again
        def stopped_with_several_in_flight() -> bool:
            if running_now(run.events(), rank=0) <= 1:
                return False
            a.send_signal(signal.SIGSTOP)
            if running_now(run.events(), rank=0) > 1:
                return True
            a.send_signal(signal.SIGCONT)
            return False

        _wait_for(stopped_with_several_in_flight, 120, "rank A to run several groups at once")
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=30)
    finally:
        if a.poll() is None:
            a.kill()
    in_flight = running_now(run.events(), rank=0)
    assert in_flight > 1
    b = _worker(redis_url, run_id, 1, "B", tmp_path / "b.log")
    try:
        _wait_for(run.all_terminal, 180, "every sample to reach a terminal event")
        _wait_for(run.nothing_pending, 60, "the rollout group to have nothing pending")
    finally:
        b.send_signal(signal.SIGTERM)
        try:
            b.wait(timeout=30)
        except subprocess.TimeoutExpired:
            b.kill()
    events = audited_clean(run.log.read())
    ended = ended_once(events)
    assert set(ended) == {f"g{g:06d}/{i}" for g in range(groups) for i in range(run.n)}  # nothing lost
    started = Counter(e.payload.sample_id for e in events if isinstance(e.payload, ev.SampleStarted))
    assert all(c == 1 for c in started.values()), started.most_common(3)  # never generated twice
    lost = [e.payload for e in events if isinstance(e.payload, ev.SampleFailed)]
    assert {p.group_id for p in lost if p.rank == 1} and all("worker lost" in p.error for p in lost)
    assert len({p.group_id for p in lost}) == in_flight  # B closed each group A had in flight, once
    run.client.close()


def running_now(events: list[ev.Event], rank: int) -> int:
    """Groups the rank has started and not yet ended, at the log's end."""
    open_samples: dict[str, set[str]] = {}
    for e in events:
        p = e.payload
        if isinstance(p, ev.SampleStarted) and p.rank == rank:
            open_samples.setdefault(p.group_id, set()).add(p.sample_id)
        elif isinstance(p, TERMINAL) and _group_of(p) in open_samples:
            open_samples[_group_of(p)].discard(_sample_id(p))
    return sum(1 for samples in open_samples.values() if samples)


@pytest.mark.parametrize(("kv_cache_tokens", "at_once"), [(250, 2), (0, 6)], ids=["kv-bounded", "kv-unreported"])
def test_a_rank_starts_no_more_groups_than_its_engines_kv_cache_holds(
    redis_url: str, run_id: str, tmp_path: Path, kv_cache_tokens: int, at_once: int
) -> None:
    """Six slots, eight groups of 2 samples x (7 prompt + 40 tokens) = 94 tokens at worst each. An engine that
    reports a KV cache of 250 tokens (cap 0.9: 225) runs two groups at once, never three; one that reports none runs
    one per slot. The simulated engine (declared token times) stands in for a server whose cache fills."""
    import copy
    import threading

    from test_worker_kill import _wait_for as wait_for

    from rolledger.workers.engines.simulated_engine import SimulatedEngine
    from rolledger.workers.roles.rank import RankWorker

    run = Run(
        redis_url,
        run_id,
        tmp_path,
        groups=8,
        max_tokens=40,
        ranks=1,
        rank_slots=6,
        engine="simulated",
        simulated={"lengths": [40], "time_scale": 0.2, "kv_cache_tokens": kv_cache_tokens},
    )
    assert 2 * run.n * (7 + 40) <= 0.9 * 250 < 3 * run.n * (7 + 40) or kv_cache_tokens == 0
    engine = SimulatedEngine(copy.deepcopy(run.model), run.tok, run.cfg.simulated, rank=0)
    worker = RankWorker(run.client, run.run_id, 0, engine)
    thread: threading.Thread = worker.start()
    try:
        wait_for(run.all_terminal, 60, "every sample to reach a terminal event")
    finally:
        worker.stop()
        thread.join(timeout=30)
    events = run.events()
    ended_once(events)
    assert running_at_once(events)[0] == at_once


@pytest.mark.parametrize(
    ("capacity", "at_once", "handed"),
    [("groups", 4, 8), ("sequences", 3, 4)],
    ids=["in-groups", "in-sequences"],
)
def test_in_sequences_a_straggler_holds_one_sequence_not_a_slot(
    redis_url: str, run_id: str, tmp_path: Path, capacity: str, at_once: int, handed: int
) -> None:
    """Four slots, an engine that runs 4 sequences at once (simulated.max_num_seqs, as vLLM's max_num_seqs), six
    groups of 2 samples: 10 tokens and a 200-token straggler each. In groups a rank takes 4 groups, 8 sequences:
    the engine runs 4 and the others wait in it. In sequences it takes two (4 sequences), and once their short
    samples end a third (two stragglers + 2 = 4): three groups at once, and never more sequences than the engine
    runs."""
    import copy
    import threading

    from test_worker_kill import _wait_for as wait_for

    from rolledger.workers.engines.simulated_engine import SimulatedEngine
    from rolledger.workers.roles.rank import RankWorker

    run = Run(
        redis_url,
        run_id,
        tmp_path,
        groups=6,
        max_tokens=200,
        ranks=1,
        rank_slots=4,
        rank_capacity=capacity,
        engine="simulated",
        simulated={"lengths": [10, 200], "time_scale": 0.1, "max_num_seqs": 4},
    )
    assert run.n == 2
    engine = SimulatedEngine(copy.deepcopy(run.model), run.tok, run.cfg.simulated, rank=0)
    worker = RankWorker(run.client, run.run_id, 0, engine)
    thread: threading.Thread = worker.start()
    try:
        wait_for(run.all_terminal, 120, "every sample to reach a terminal event")
    finally:
        worker.stop()
        thread.join(timeout=30)
    events = run.events()
    ended_once(events)
    assert running_at_once(events)[0] == at_once
    assert engine.peak_sequences == handed  # sequences the rank handed the engine at once (running or waiting)
    assert engine.peak_running <= 4
    done = [e.payload for e in events if isinstance(e.payload, ev.SampleFinished)]
    assert sorted(len(p.trajectory.token_ids) for p in done) == [10] * 6 + [200] * 6
