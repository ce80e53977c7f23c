"""Heartbeats for in-flight rollout work: a live rank keeps the group it generates however long it takes, and only a
rank that missed its beats (a stopped process) loses it. Real redis-server, the real torch engine (slowed by
tests/slow_engine.py), real rank workers (one a separate process, SIGSTOPped and SIGCONTinued)."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import torch
from slow_engine import SlowEngine

from rolledger.events.consumer import GroupConsumer
from rolledger.events.envelope import make_event
from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig, SamplingParams
from rolledger.workers.engines.torch_engine import TorchEngine
from rolledger.workers.policy.policy_model import build_model, build_tokenizer, policy_state, save_policy
from rolledger.workers.roles.rank import RankWorker
from rolledger.workers.weights.tensors import state_digest
from rolledger.workflows.admission import sample_reserve
from rolledger.workflows.audit import audit
from rolledger.workflows.reducer import replay
from rolledger.workflows.scheduler import PromptItem

pytestmark = pytest.mark.slow
N = 2
HEARTBEAT_S = 0.3
LOST_AFTER_S = 1.5
TERMINAL = (ev.SampleFinished, ev.SampleFailed, ev.SampleCancelled)


def _sample_id(p: ev.Payload) -> str:
    if isinstance(p, ev.SampleFinished):
        return p.trajectory.trajectory_id
    assert isinstance(p, ev.SampleFailed | ev.SampleCancelled), p
    return p.sample_id


def _wait_for(predicate: Callable[[], bool], deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling with a deadline


class Run:
    """A run log with RunStarted and `groups` admitted groups, no coordinator: the rank workers take them."""

    def __init__(
        self,
        redis_url: str,
        run_id: str,
        tmp_path: Path,
        groups: int,
        max_tokens: int = 8,
        reserve: int | None = None,
        **config: object,
    ) -> None:
        """`reserve`: the bytes each sample's admission reserves (None: what rolledger's admission reserves)."""
        torch.manual_seed(0)
        self.n = N
        self.cfg = RunConfig.model_validate(
            {
                "ranks": 2,
                "group_size": N,
                "sampling": {"max_tokens": max_tokens},
                "recovery": {"heartbeat_s": HEARTBEAT_S, "lost_after_s": LOST_AFTER_S},
                **config,
            }
        )
        self.tok = build_tokenizer()
        self.model = build_model(self.cfg.model, len(self.tok), 0)
        self.model_dir = save_policy(tmp_path / "model", self.model, self.tok)
        self.client = redis.Redis.from_url(redis_url)
        self.run_id = run_id
        self.log = EventLog(self.client, run_id)
        self.groups = groups
        self.emit(
            ev.RunStarted(
                config=self.cfg,
                initial_weights_digest=state_digest(policy_state(self.model)),
                model_dir=str(self.model_dir),
            )
        )
        prompt = list(self.tok("12+34=")["input_ids"])
        sampling = SamplingParams(max_tokens=max_tokens, stop_token_ids=())
        for g in range(groups):
            self.emit(
                ev.GroupAdmitted(
                    group_id=f"g{g:06d}",
                    prompt_id=f"p{g}",
                    prompt_token_ids=prompt,
                    n=N,
                    sampling=sampling,
                    partial_policy=self.cfg.partial_policy,
                    answer="46",
                    est_remaining_tokens=max_tokens * N,
                    est_bytes=N
                    * (
                        sample_reserve(f"g{g:06d}", PromptItem(g, f"p{g}", tuple(prompt), "46"), N, sampling, False)
                        if reserve is None
                        else reserve
                    ),
                    queued_bytes=0,
                    byte_cap=self.cfg.admission.max_queued_bytes,
                )
            )

    def emit(self, p: ev.Payload) -> None:
        self.log.append(make_event(p, run_id=self.run_id, producer="test", policy_version=0))

    def events(self) -> list[ev.Event]:
        return [s.event for s in self.log.read()]

    def all_terminal(self) -> bool:
        ends = {_sample_id(e.payload) for e in self.events() if isinstance(e.payload, TERMINAL)}
        return len(ends) == self.groups * N

    def rank(self, rank: int, delay_s: float = 0.0) -> RankWorker:
        engine = TorchEngine(copy.deepcopy(self.model), self.tok, rank=rank)
        return RankWorker(self.client, self.run_id, rank, SlowEngine(engine, delay_s) if delay_s else engine)

    def nothing_pending(self) -> bool:
        return GroupConsumer.work(self.client, self.run_id, "rollout", "observer").pending() == 0


def test_a_live_rank_slower_than_lost_after_keeps_its_group(redis_url: str, run_id: str, tmp_path: Path) -> None:
    run = Run(redis_url, run_id, tmp_path, groups=4)
    slow, fast = run.rank(0, delay_s=2 * LOST_AFTER_S), run.rank(1)
    threads = [slow.start(), fast.start()]
    try:
        _wait_for(run.all_terminal, 50, "every sample to reach a terminal event")
        _wait_for(run.nothing_pending, 20, "the rollout group to have nothing pending")
    finally:
        slow.stop()
        fast.stop()
        for t in threads:
            t.join(timeout=30)
    events = run.events()
    assert not [e for e in events if isinstance(e.payload, ev.SampleFailed)]  # nothing reclaimed as "worker lost"
    ended = Counter(_sample_id(e.payload) for e in events if isinstance(e.payload, TERMINAL))
    assert all(c == 1 for c in ended.values()) and len(ended) == 4 * N
    finished_by = Counter(e.payload.trajectory.rank for e in events if isinstance(e.payload, ev.SampleFinished))
    assert finished_by[0] >= N  # the slow rank finished the group it held for longer than lost_after_s
    slow_gen_ms = [
        e.payload.gen_ms for e in events if isinstance(e.payload, ev.SampleFinished) and e.payload.trajectory.rank == 0
    ]
    assert min(slow_gen_ms) > LOST_AFTER_S * 1000
    state = replay(events)
    assert state.anomalies == [] and state.late_results == 0
    run.client.close()


def _slow_rank_process(redis_url: str, run_id: str, log: Path, delay_s: float) -> subprocess.Popen[bytes]:
    env = {**os.environ, "ROLLEDGER_TEST_THREADS": "1", "OMP_NUM_THREADS": "1"}
    script = Path(__file__).parent / "_slow_rank_proc.py"
    cmd = [sys.executable, str(script), redis_url, run_id, "0", "A", str(delay_s)]
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def test_a_stopped_rank_loses_its_group_to_a_live_one_and_appends_nothing_for_it_after_sigcont(
    redis_url: str, run_id: str, tmp_path: Path
) -> None:
    run = Run(redis_url, run_id, tmp_path, groups=3)
    a_log = tmp_path / "a.log"
    a = _slow_rank_process(redis_url, run_id, a_log, delay_s=3.0)
    b: RankWorker | None = None
    try:
        # A has started a group: its samples are in flight, the engine inside its 3 s delay
        _wait_for(
            lambda: any(isinstance(e.payload, ev.SampleStarted) and e.payload.rank == 0 for e in run.events()),
            40,
            "rank A to start a group",
        )
        a.send_signal(signal.SIGSTOP)  # its heartbeat stops with it
        stopped_at = time.monotonic()
        b = run.rank(1)
        thread = b.start()
        _wait_for(run.all_terminal, 40, "rank B to reclaim A's group and finish the others")
        assert time.monotonic() - stopped_at > LOST_AFTER_S  # not reclaimed before A missed its beats
        a.send_signal(signal.SIGCONT)
        _wait_for(lambda: b"reclaimed by another rank" in a_log.read_bytes(), 30, "A to learn it lost its claim")
        _wait_for(run.nothing_pending, 20, "the rollout group to have nothing pending")
    finally:
        if a.poll() is None:
            a.send_signal(signal.SIGCONT)
            a.send_signal(signal.SIGTERM)
            try:
                a.wait(timeout=30)
            except subprocess.TimeoutExpired:
                a.kill()
        if b is not None:
            b.stop()
            thread.join(timeout=30)
    events = run.events()
    lost = [e.payload for e in events if isinstance(e.payload, ev.SampleFailed)]
    assert lost and all(p.rank == 1 and "worker lost" in p.error for p in lost)  # B closed A's orphans
    started = Counter(e.payload.sample_id for e in events if isinstance(e.payload, ev.SampleStarted))
    assert all(c == 1 for c in started.values()), started  # nothing generated twice
    a_after = [
        e
        for e in events
        if isinstance(e.payload, TERMINAL)
        and e.producer.startswith("rank-0")
        and _sample_id(e.payload) in {p.sample_id for p in lost}
    ]
    assert a_after == []  # A appended nothing for the samples it lost
    state = replay(events)
    assert state.anomalies == [], state.anomalies
    ended = Counter(_sample_id(e.payload) for e in events if isinstance(e.payload, TERMINAL))
    assert all(c == 1 for c in ended.values()), ended  # nothing counted twice
    report = audit(events)
    assert not report.violations, report.render()
    run.client.close()
