"""Entry points of the distributed processes (`rolledger coordinator`, `rolledger worker KIND`).

Each process reads what it needs from the run's log (RunStarted: the config and the model directory), builds its
part, and runs until the run finishes or it receives SIGTERM/SIGINT. `rollout` and `rank` are the same worker: an
inference rank generates and takes part in updates through one engine.

A Redis outage is ridden out by the client (events/outage.py: backoff up to ROLLEDGER_REDIS_DEADLINE_S, one
warning line); when it lasts past the deadline the process exits with code 3 and one line on stderr, and if Redis
answers again by then it first appends the fact `WorkerLost` ("redis unreachable for N s") so the log says why.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import redis
import structlog

from rolledger.events.archive import iter_run
from rolledger.events.connection import connect
from rolledger.events.envelope import make_event
from rolledger.events.outage import RedisUnavailable
from rolledger.events.store import EventLog, RunClosed
from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.workers.runtime import gc_policy

if TYPE_CHECKING:  # torch comes in with the worker a process builds, after the finished-run check
    from rolledger.workers.engines.protocol import Engine
    from rolledger.workers.runtime.runtime import Worker

log = structlog.get_logger("process")
EXIT_REDIS_UNAVAILABLE = 3
EXIT_WORKER_FAILED = 3  # the worker stopped on an error: "the run failed" of the CLI's exit codes


class RunNotStarted(LookupError):
    """The run has no RunStarted in its log: nothing for this process to do (the CLI: one line, exit 2)."""


def _run_started(client: redis.Redis, run_id: str) -> ev.RunStarted:
    for stored in iter_run(client, run_id):  # archive + live: a trimmed stream no longer holds RunStarted
        if isinstance(stored.event.payload, ev.RunStarted):
            return stored.event.payload
    raise RunNotStarted(f"run {run_id!r} has no RunStarted event yet; start it with `rolledger run` first")


def finished_already(client: redis.Redis, run_id: str, who: str) -> bool:
    """A process started after its run's RunFinished (a restart that came too late, a supervisor's retry) has
    nothing to do: it says so in one line and exits 0 before loading a model or importing torch."""
    at = EventLog(client, run_id).finished_at()
    if at is None:
        return False
    print(f"rolledger {who}: run {run_id} already finished (RunFinished at {at}); nothing to do", file=sys.stderr)
    return True


def _serve(worker: Worker) -> int:
    def stop(signum: int, _frame: object) -> None:
        worker.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with gc_policy.serving():  # the model and the worker as built are frozen (workers/runtime/gc_policy.py)
        worker._main()
    if isinstance(worker.error, RedisUnavailable):
        raise worker.error
    return 0 if worker.error is None else EXIT_WORKER_FAILED


def gave_up(redis_url: str, run_id: str, name: str, kind: str, exc: RedisUnavailable) -> int:
    """The end of a process whose Redis stayed away past the deadline: one line, exit 3; WorkerLost first when
    Redis answers again by now (one attempt, a short deadline)."""
    try:
        client = connect(redis_url, retry_deadline=2.0)
        payload = ev.WorkerLost(worker=name, kind=kind, error=f"redis unreachable for {exc.seconds:.0f} s")
        EventLog(client, run_id).append(make_event(payload, run_id=run_id, producer=name, policy_version=0))
    except (RedisUnavailable, RunClosed, redis.RedisError, ValueError):
        pass  # still away (or the run is over): the exit line says it
    print(f"rolledger {kind} {name}: {exc}; exiting", file=sys.stderr)
    return EXIT_REDIS_UNAVAILABLE


def _guarded(redis_url: str, run_id: str, name: str, kind: str, body: Callable[[], int]) -> int:
    try:
        return body()
    except RedisUnavailable as exc:
        return gave_up(redis_url, run_id, name, kind, exc)


def run_coordinator(redis_url: str, run_id: str) -> int:
    name = f"coordinator@{socket.gethostname()}:{os.getpid()}"
    return _guarded(redis_url, run_id, name, "coordinator", lambda: _run_coordinator(redis_url, run_id, name))


def _run_coordinator(redis_url: str, run_id: str, name: str) -> int:
    client = connect(redis_url)
    if finished_already(client, run_id, "coordinator"):
        return 0
    started = _run_started(client, run_id)  # before torch is imported: a run that is not there is refused at once
    from rolledger.workers.operator.local_run import prompt_items
    from rolledger.workers.policy.policy_model import load_policy
    from rolledger.workers.roles.coordinator import Coordinator

    _, tokenizer = load_policy(Path(started.model_dir))
    return _serve(Coordinator(client, run_id, name, prompt_items(started.config, tokenizer)))


def run_worker(
    kind: str, redis_url: str, run_id: str, *, rank: int = 0, name: str | None = None, claim_idle_ms: int | None = None
) -> int:
    shown = name or (f"rank-{rank}" if kind in ("rollout", "rank") else kind)
    return _guarded(
        redis_url,
        run_id,
        shown,
        kind,
        lambda: _run_worker(kind, redis_url, run_id, rank=rank, name=name, claim_idle_ms=claim_idle_ms),
    )


def _run_worker(
    kind: str, redis_url: str, run_id: str, *, rank: int = 0, name: str | None = None, claim_idle_ms: int | None = None
) -> int:
    client = connect(redis_url)
    if finished_already(client, run_id, f"worker {kind}"):
        return 0
    started = _run_started(client, run_id)  # before torch is imported
    from rolledger.workers.policy.policy_model import load_policy

    cfg: RunConfig = started.config
    model, tokenizer = load_policy(Path(started.model_dir))
    worker: Worker
    if kind in ("rollout", "rank"):
        from rolledger.workers.policy.policy_model import policy_state
        from rolledger.workers.roles.rank import RankWorker

        initial = {k: v.clone() for k, v in policy_state(model).items()}  # what a quarantined rank rejoins on at v0
        engine: Engine
        if cfg.engine == "vllm":  # this process is the rank agent of a vLLM server (cfg.vllm_urls[rank])
            from rolledger.workers.engines.factory import connect_vllm_rank

            engine = connect_vllm_rank(cfg, rank, Path(started.model_dir))
        elif cfg.engine == "sglang":  # the rank agent of an SGLang server (cfg.sglang_urls[rank])
            from rolledger.workers.engines.factory import connect_sglang_rank

            engine = connect_sglang_rank(cfg, rank, Path(started.model_dir))
        elif cfg.engine == "simulated":  # benchmarks: declared token times (cfg.simulated)
            from rolledger.workers.engines.factory import simulated_engine

            engine = simulated_engine(cfg, model, tokenizer, rank=rank)
        else:
            from rolledger.workers.engines.factory import torch_engine

            engine = torch_engine(cfg, model, tokenizer, rank=rank)
        worker = RankWorker(
            client,
            run_id,
            rank,
            engine,
            claim_idle_ms=claim_idle_ms,
            initial_weights=lambda: initial,
            tokenizer=tokenizer,
        )
        if name:
            worker.name = name
    elif kind == "reward":
        from rolledger.workers.roles.reward import RewardWorker

        worker = RewardWorker(client, run_id, name or "reward", tokenizer, claim_idle_ms=claim_idle_ms)
    elif kind == "trainer":
        from rolledger.workers.roles.trainer import TrainerWorker
        from rolledger.workers.weights.transport import close_store, open_trainer_store

        staging = open_trainer_store(cfg, Path(started.model_dir).parent / "staging")
        worker = TrainerWorker(client, run_id, name or "trainer", model, staging)
        log.info("worker starting", kind=kind, run=run_id, name=worker.name)
        try:
            return _serve(worker)
        finally:  # a weight server's threads must not outlive the interpreter (they sit in C++ calls)
            close_store(staging)
    else:
        raise SystemExit(f"unknown worker kind {kind!r}")
    log.info("worker starting", kind=kind, run=run_id, name=worker.name)
    return _serve(worker)
