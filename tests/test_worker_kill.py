"""A rollout worker PROCESS killed with SIGKILL mid-group: another worker reclaims its entries; nothing is lost and no
sample is counted twice. Real processes (`rolledger worker rank`), a real redis-server, the real torch engine."""

from __future__ import annotations

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

from rolledger.events.consumer import GroupConsumer
from rolledger.events.envelope import make_event
from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig, SamplingParams
from rolledger.workers.policy.policy_model import build_model, build_tokenizer, policy_state, save_policy
from rolledger.workers.weights.tensors import state_digest
from rolledger.workflows.admission import sample_reserve
from rolledger.workflows.scheduler import PromptItem

pytestmark = pytest.mark.slow
GROUPS = 6
N = 4
TERMINAL = (ev.SampleFinished, ev.SampleFailed, ev.SampleCancelled)


def _sample_id(p: ev.Payload) -> str:
    if isinstance(p, ev.SampleFinished):
        return p.trajectory.trajectory_id
    assert isinstance(p, ev.SampleFailed | ev.SampleCancelled), p
    return p.sample_id


def _worker(redis_url: str, run_id: str, rank: int, name: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "ROLLEDGER_TEST_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "rolledger.workers.operator.cli",
        "--json-logs",
        "worker",
        "rank",
        "--redis",
        redis_url,
        "--run",
        run_id,
        "--rank",
        str(rank),
        "--name",
        name,
        "--claim-idle-ms",
        "500",
    ]
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def _wait_for(predicate: Callable[[], bool], deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling the log with a deadline


def test_sigkilled_rollout_worker_loses_nothing_and_counts_nothing_twice(
    redis_url: str, run_id: str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    cfg = RunConfig.model_validate({"group_size": N, "sampling": {"max_tokens": 24}})
    tok = build_tokenizer()
    model = build_model(cfg.model, len(tok), 0)
    model_dir = save_policy(tmp_path / "model", model, tok)
    client = redis.Redis.from_url(redis_url)
    log = EventLog(client, run_id)

    def emit(p: ev.Payload) -> None:
        log.append(make_event(p, run_id=run_id, producer="test", policy_version=0))

    emit(ev.RunStarted(config=cfg, initial_weights_digest=state_digest(policy_state(model)), model_dir=str(model_dir)))
    prompt = list(tok("12+34=")["input_ids"])
    sampling = SamplingParams(max_tokens=24, stop_token_ids=())
    for g in range(GROUPS):
        emit(
            ev.GroupAdmitted(
                group_id=f"g{g:06d}",
                prompt_id=f"p{g}",
                prompt_token_ids=prompt,
                n=N,
                sampling=sampling,
                partial_policy=cfg.partial_policy,
                answer="46",
                est_remaining_tokens=8 * N,
                est_bytes=N
                * sample_reserve(f"g{g:06d}", PromptItem(g, f"p{g}", tuple(prompt), "46"), N, sampling, False),
                queued_bytes=0,
                byte_cap=10**9,
            )
        )

    def events() -> list[ev.Event]:
        return [s.event for s in log.read()]

    # A takes 60 s longer per group, so it surely holds a group in flight when it is killed: a quick A could finish
    # every group between two polls of a loaded test process, and leave B nothing to reclaim
    env = {**os.environ, "ROLLEDGER_TEST_THREADS": "1", "OMP_NUM_THREADS": "1"}
    slow_a = [sys.executable, str(Path(__file__).parent / "_slow_rank_proc.py"), redis_url, run_id, "0", "A", "60"]
    a = subprocess.Popen(slow_a, stdout=(tmp_path / "a.log").open("wb"), stderr=subprocess.STDOUT, env=env)
    try:
        # kill A as soon as it has started a group (its samples are in flight, its entry pending)
        _wait_for(
            lambda: any(isinstance(e.payload, ev.SampleStarted) for e in events()), 120, "worker A to start a group"
        )
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=30)
    finally:
        if a.poll() is None:
            a.kill()
    b = _worker(redis_url, run_id, 1, "B", tmp_path / "b.log")
    try:

        def all_terminal() -> bool:
            ends = {_sample_id(e.payload) for e in events() if isinstance(e.payload, TERMINAL)}
            return len(ends) == GROUPS * N

        _wait_for(all_terminal, 180, "every sample to reach a terminal event")
        consumer = GroupConsumer.work(client, run_id, "rollout", "observer")
        _wait_for(lambda: consumer.pending() == 0, 60, "the rollout group to have nothing pending")
    finally:
        b.send_signal(signal.SIGTERM)
        try:
            b.wait(timeout=30)
        except subprocess.TimeoutExpired:
            b.kill()
    log_events = events()
    started = Counter(e.payload.sample_id for e in log_events if isinstance(e.payload, ev.SampleStarted))
    ended = Counter(_sample_id(e.payload) for e in log_events if isinstance(e.payload, TERMINAL))
    assert set(ended) == {f"g{g:06d}/{i}" for g in range(GROUPS) for i in range(N)}  # nothing lost
    assert all(c == 1 for c in ended.values()), ended.most_common(3)  # each sample ends exactly once
    assert all(c == 1 for c in started.values()), started.most_common(3)  # never generated twice
    killed = [e.payload for e in log_events if isinstance(e.payload, ev.SampleFailed)]
    if killed:  # A died mid-group: B closed A's orphaned samples instead of running them again
        assert all("worker lost" in p.error for p in killed)
    by_rank = Counter(e.payload.trajectory.rank for e in log_events if isinstance(e.payload, ev.SampleFinished))
    assert by_rank[1] > 0  # B did the rest
    client.close()
