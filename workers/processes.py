"""Entry points of the distributed processes (`rolledger coordinator`, `rolledger worker KIND`).

Each process reads what it needs from the run's log (RunStarted: the config and the model directory), builds its
part, and runs until the run finishes or it receives SIGTERM/SIGINT. `rollout` and `rank` are the same worker: an
inference rank generates and takes part in updates through one engine.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import redis
import structlog

from rolledger.events.connection import connect
from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.workers.engine import Engine
from rolledger.workers.runtime import Worker

log = structlog.get_logger("process")


def _run_started(client: redis.Redis, run_id: str) -> ev.RunStarted:
    for stored in EventLog(client, run_id).read():
        if isinstance(stored.event.payload, ev.RunStarted):
            return stored.event.payload
    raise SystemExit(f"run {run_id} has no RunStarted event yet; start it with `rolledger run` first")


def _serve(worker: Worker) -> int:
    def stop(signum: int, _frame: object) -> None:
        worker.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker._main()
    return 0 if worker.error is None else 1


def run_coordinator(redis_url: str, run_id: str) -> int:
    from rolledger.workers.coordinator import Coordinator
    from rolledger.workers.local_run import prompt_items
    from rolledger.workers.policy_model import load_policy

    client = connect(redis_url)
    started = _run_started(client, run_id)
    _, tokenizer = load_policy(Path(started.model_dir))
    name = f"coordinator@{socket.gethostname()}:{os.getpid()}"
    return _serve(Coordinator(client, run_id, name, prompt_items(started.config, tokenizer)))


def run_worker(
    kind: str, redis_url: str, run_id: str, *, rank: int = 0, name: str | None = None, claim_idle_ms: int | None = None
) -> int:
    from rolledger.workers.policy_model import load_policy

    client = connect(redis_url)
    started = _run_started(client, run_id)
    cfg: RunConfig = started.config
    model, tokenizer = load_policy(Path(started.model_dir))
    worker: Worker
    if kind in ("rollout", "rank"):
        from rolledger.workers.engines.torch_engine import TorchEngine
        from rolledger.workers.policy_model import policy_state
        from rolledger.workers.rank import RankWorker

        initial = {k: v.clone() for k, v in policy_state(model).items()}  # what a quarantined rank rejoins on at v0
        engine: Engine
        if cfg.engine == "vllm":  # this process is the rank agent of a vLLM server (cfg.vllm_urls[rank])
            from rolledger.workers.engines.factory import connect_vllm_rank

            engine = connect_vllm_rank(cfg, rank, Path(started.model_dir))
        else:
            engine = TorchEngine(model, tokenizer, rank=rank, interruptible=cfg.interruptible)
        worker = RankWorker(client, run_id, rank, engine, claim_idle_ms=claim_idle_ms, initial_weights=lambda: initial)
        if name:
            worker.name = name
    elif kind == "reward":
        from rolledger.workers.reward import RewardWorker

        worker = RewardWorker(client, run_id, name or "reward", tokenizer, claim_idle_ms=claim_idle_ms)
    elif kind == "trainer":
        from rolledger.workers.staging_store import DirectoryStagingStore
        from rolledger.workers.trainer import TrainerWorker

        staging = DirectoryStagingStore(cfg.update.staging_dir or Path(started.model_dir).parent / "staging")
        worker = TrainerWorker(client, run_id, name or "trainer", model, staging)
    else:
        raise SystemExit(f"unknown worker kind {kind!r}")
    log.info("worker starting", kind=kind, run=run_id, name=worker.name)
    return _serve(worker)
