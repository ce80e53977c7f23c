"""The torch engine in a process of its own (workers/engines/engine_process; `torch_engine.process`). The engine
contract runs against it in tests/test_engine_contract.py; here, what the process boundary adds: cancellation sent
across it, the child's death failing every call (the rank fails closed), a run whose engines run in such processes,
and a SIGKILLed rank process leaving no engine process behind. A real redis-server, the real torch engine, real
`rolledger worker rank` processes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from functools import partial
from pathlib import Path

import pytest
from audit_check import audited_log
from engine_contract import generate_in_thread
from test_heartbeats import Run
from test_rank_slots import ended_once, running_at_once
from test_run_loop import execute, small
from test_worker_kill import _wait_for, _worker

from rolledger.schemas.config import ModelConfig, SamplingParams
from rolledger.workers.engines.engine_process import EngineProcess
from rolledger.workers.engines.protocol import EngineError, GroupOutput
from rolledger.workers.engines.torch_engine import TorchEngine
from rolledger.workers.policy.policy_model import build_model, build_tokenizer

pytestmark = pytest.mark.slow
DEADLINE_S = 60.0
# greedy: this tiny random policy never samples <eos> greedily from this prompt, so an uncut sample runs to max_tokens
LONG = SamplingParams(temperature=0.0, max_tokens=200)
PROMPT = [1, 4, 5, 14, 6, 15]


def engine_process(batch_groups: bool = False) -> EngineProcess:
    tok = build_tokenizer()
    model = build_model(ModelConfig(max_position_embeddings=256), len(tok), 0)
    return EngineProcess(partial(TorchEngine, model, tok, batch_groups=batch_groups), torch_threads=1)


def test_a_sample_cancelled_in_the_worker_is_cut_in_the_engine_process() -> None:
    engine = engine_process(batch_groups=True)
    try:
        cut_from = threading.Event()
        polled: list[int] = []

        def closed(i: int) -> bool:  # the worker's check, asked on the caller's thread every cancel_poll_s
            polled.append(i)
            return i >= 2 and cut_from.is_set()

        thread, result = generate_in_thread(lambda: engine.generate(PROMPT, 4, LONG, should_cancel=closed))
        _wait_for(lambda: len(polled) >= 8, DEADLINE_S, "the caller to poll should_cancel")
        cut_from.set()
        thread.join(DEADLINE_S)
        assert not thread.is_alive()
        out = result[0]
        assert isinstance(out, GroupOutput), out
        assert [s.finish_reason for s in out.samples] == ["length", "length", "abort", "abort"]
        assert all(len(s.token_ids) == 200 for s in out.samples[:2])
        assert all(len(s.token_ids) < 200 for s in out.samples[2:])  # cut short, in the child
        assert engine.stats.cancelled_samples == 2
    finally:
        engine.close()


def test_the_engine_process_dying_fails_the_call_in_flight_and_every_later_one() -> None:
    engine = engine_process()
    thread, result = generate_in_thread(lambda: engine.generate(PROMPT, 2, LONG))
    assert engine.pid is not None
    os.kill(engine.pid, signal.SIGKILL)
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), "a call in flight hung when the engine process died"
    assert isinstance(result[0], EngineError) and "exit code -9" in str(result[0]), result
    with pytest.raises(EngineError, match="exit code -9"):
        engine.health()
    engine.close()


def test_a_run_whose_torch_engines_run_in_processes_of_their_own_audits_clean(
    redis_url: str, run_id: str, tmp_path: Path
) -> None:
    cfg = small(
        ranks=2,
        rank_slots=3,
        steps=2,
        trainer={"warm_start_steps": 20, "groups_per_step": 3},
        torch_engine={"process": True, "max_batch_groups": 2},
    )
    events, summary = execute(redis_url, run_id, tmp_path, cfg)
    assert summary.status == "completed" and summary.steps == 2
    audited_log(redis_url, run_id)
    ended_once(events)
    assert max(running_at_once(events).values()) > 1  # several groups in flight on a rank, through the process
    assert not [p.name for p in multiprocessing.active_children() if p.name.startswith("torch-rank")]  # closed


def children_of(pid: int) -> list[int]:
    """The pids of a live process's children (Linux /proc)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def running(pid: int) -> bool:
    """Is the process alive? (a zombie left for its new parent to reap is not)"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_sigkilled_rank_process_leaves_no_engine_process_behind(redis_url: str, run_id: str, tmp_path: Path) -> None:
    run = Run(redis_url, run_id, tmp_path, groups=4, max_tokens=24, rank_slots=2, torch_engine={"process": True})
    worker = _worker(redis_url, run_id, 0, "A", tmp_path / "a.log")
    try:
        _wait_for(lambda: any(e.payload.type == "SampleFinished" for e in run.events()), 180, "a first sample")
        children = children_of(worker.pid)  # the engine's process (and multiprocessing's resource tracker)
        assert children and all(map(running, children)), children
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
        _wait_for(lambda: not any(map(running, children)), DEADLINE_S, "the engine process to end with its rank")
    finally:
        if worker.poll() is None:
            worker.kill()
        run.client.close()
