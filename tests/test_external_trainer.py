"""Bring your own trainer: `examples/torch_trainer.py`, a plain torch loop on the public client API
(`rolledger.client`), started as its own process against a real run started with `--trainer external`
(LocalRun(external_trainer=True)): the policy learns, the audit is clean, the log names the external trainer as the
producer of every step; killed mid-run and started again it resumes from the published version, and the next
version it stages is trained from the published weights (invariant 9), not from the initial checkpoint."""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
from test_run_loop import small

from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
from rolledger.workers.operator.local_run import LocalRun, RunOptions
from rolledger.workflows.audit import audit
from rolledger.workflows.summary import Summary

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "torch_trainer.py"
TRL_EXAMPLE = ROOT / "examples" / "trl_trainer.py"  # the same loop with TRL's GRPOTrainer computing the loss
DEADLINE_S = 300.0
LR = "1e-4"


class BackgroundRun:
    """A run without its trainer, driven on a thread (the driver handles no signals there)."""

    def __init__(self, redis_url: str, run_id: str, tmp_path: Path, **cfg: object) -> None:
        self.run = LocalRun(
            RunOptions(
                config=small(**cfg),  # type: ignore[arg-type]
                redis_url=redis_url,
                run_id=run_id,
                runs_dir=tmp_path,
                external_trainer=True,
                deadline_s=DEADLINE_S,
                handle_signals=False,
            )
        )
        self.summary: list[Summary] = []
        self.thread = threading.Thread(target=lambda: self.summary.append(self.run.execute()), daemon=True)
        self.thread.start()

    def wait(self) -> Summary:
        self.thread.join(DEADLINE_S + 60)
        assert self.summary, "the run did not finish"
        return self.summary[0]


def start_trainer(redis_url: str, run_id: str, name: str, example: Path = EXAMPLE) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(example), "--redis", redis_url, "--run-id", run_id, "--name", name, "--lr", LR],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )


def finish(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, out[-3000:]
    return out


def events_of(redis_url: str, run_id: str) -> list[ev.Event]:
    client = redis.Redis.from_url(redis_url)
    try:
        return [s.event for s in EventLog(client, run_id).read()]
    finally:
        client.close()


def learned_through_the_client(
    redis_url: str, run_id: str, tmp_path: Path, name: str, example: Path, steps: int = 30
) -> tuple[str, list[ev.Event], float, float]:
    """Run `steps` steps with `example` as the trainer named `name`; check what every learning run must show
    (completed, audit clean with every version's lineage checked, every step and batch by `name`); return the
    trainer's output, the events and the mean reward of the first and last 5 steps."""
    run = BackgroundRun(
        redis_url, run_id, tmp_path, steps=steps, group_size=8, trainer={"warm_start_steps": 400, "groups_per_step": 4}
    )
    out = finish(start_trainer(redis_url, run_id, name, example))
    summary = run.wait()
    assert summary.status == "completed", summary
    events = events_of(redis_url, run_id)
    report = audit(events)
    assert report.ok, report.violations
    assert report.checked[9] == steps  # every version's lineage recorded and checked
    taken = [e for e in events if isinstance(e.payload, ev.TrainStepFinished)]
    assert len(taken) == steps and {e.producer for e in taken} == {name}
    consumed = [e for e in events if isinstance(e.payload, ev.BatchConsumed)]
    assert consumed and {e.producer for e in consumed} == {name}
    assert f"published v{steps}" in out
    rewards = [e.payload.reward_mean for e in taken]  # type: ignore[attr-defined]
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    print(f"{name}: reward of the first/last 5 steps {first:.3f} -> {last:.3f}")
    return out, events, first, last


def test_the_example_trainer_learns_through_the_client_api(redis_url: str, run_id: str, tmp_path: Path) -> None:
    """40 steps, as the default run: measured gains of the last 5 steps' mean reward over the first 5's, 16 runs:
    0.064-0.136. At 30 steps (before) 12 runs gave 0.056-0.158 and a CI run 0.050, on the bound asserted."""
    _, events, first, last = learned_through_the_client(redis_url, run_id, tmp_path, "torch-example", EXAMPLE, steps=40)
    assert last > first + 0.05, (first, last)
    from rolledger.workflows.lineage import lineage

    consumed = [e for e in events if isinstance(e.payload, ev.BatchConsumed)]
    traced = lineage(events, consumed[-1].payload.trajectory_ids[0]).render()  # type: ignore[attr-defined]
    assert f"consumed by torch-example at trainer step {consumed[-1].payload.step}" in traced, traced  # type: ignore[attr-defined]


def test_the_trl_example_learns_with_trls_grpo_loss(redis_url: str, run_id: str, tmp_path: Path) -> None:
    """examples/trl_trainer.py: the loss is TRL's own (GRPOTrainer.compute_loss on the run's batches)."""
    pytest.importorskip("trl", reason="examples/trl_trainer.py needs TRL (pip install trl; in the dev extra)")
    out, _, first, last = learned_through_the_client(redis_url, run_id, tmp_path, "trl-example", TRL_EXAMPLE, steps=40)
    # 40 steps, as the torch example: measured gains over 6 runs 0.102-0.153 (idle machine). At 30 steps (before)
    # 7 runs gave 0.056-0.152, and a run on a loaded machine 0.014, below the bound asserted
    assert last > first + 0.025, (first, last)
    assert "TRL loss dapo" in out


def _wait_for_published(redis_url: str, run_id: str, version: int) -> None:
    client = redis.Redis.from_url(redis_url)
    log, after = EventLog(client, run_id), "0-0"
    deadline = time.monotonic() + DEADLINE_S
    try:
        while time.monotonic() < deadline:
            for stored in log.tail(after, block_ms=500):
                after = stored.stream_id
                p = stored.event.payload
                if isinstance(p, ev.PolicyPublished) and p.version >= version:
                    return
        raise AssertionError(f"v{version} was not published within {DEADLINE_S:g} s")
    finally:
        client.close()


def test_a_killed_external_trainer_resumes_from_the_published_version(
    redis_url: str, run_id: str, tmp_path: Path
) -> None:
    run = BackgroundRun(redis_url, run_id, tmp_path, steps=8, trainer={"warm_start_steps": 20, "groups_per_step": 2})
    first = start_trainer(redis_url, run_id, "trainer-a")
    _wait_for_published(redis_url, run_id, 3)
    first.kill()  # SIGKILL: no cleanup, mid-step or mid-update
    first.communicate(timeout=60)
    out = finish(start_trainer(redis_url, run_id, "trainer-b"))
    summary = run.wait()
    assert summary.status == "completed", summary
    events = events_of(redis_url, run_id)
    report = audit(events)
    assert report.ok, report.violations
    staged = [e for e in events if isinstance(e.payload, ev.UpdateStaged)]
    by_b = [e.payload for e in staged if e.producer == "trainer-b"]
    assert by_b, "the restarted trainer staged nothing"
    published = {
        e.payload.version: e.payload.weights_digest for e in events if isinstance(e.payload, ev.PolicyPublished)
    }
    initial = next(e.payload.initial_weights_digest for e in events if isinstance(e.payload, ev.RunStarted))
    resumed = by_b[0]
    assert isinstance(resumed, ev.UpdateStaged)
    # trained from the published version it found, not from the initial checkpoint it was started with
    assert resumed.parent_weights_digest == published[resumed.base_version] != initial
    assert report.checked[9] == len(staged) == 8
    assert "connected to" in out and f"weights v{resumed.base_version}" in out
