"""Benchmark of the live state over a long run (run by hand): does a decision tick, the state's size, its digest and a
snapshot cost the same at the last step as at an early one? (issue 12: "within 1.2x of step 1").

    python bench/bench_state.py [--steps 200] [--early 2] [--groups-per-step 32] [--group-size 8] [--ranks 2]
                                [--update-every 4] [--ticks 20]

No Redis: a synthetic run (bench_replay.RunWriter's events: per group GroupAdmitted, n x SampleStarted/Finished/Scored,
GroupCompleted; per step BatchConsumed + TrainStepFinished; a weight-update transaction every `--update-every` steps),
pipelined as an asynchronous run is (each step generates the next step's groups while the trainer consumes the
previous step's, so one step's groups are always live), is folded event by event, twice in one process:

- baseline: the reducer with retirement switched off (every group stays in `RunState.groups` and every closed
  update's record in `RunState.updates`, as before issue 12; the deciders then scan every group, as they did);
- bounded: the reducer as it is (terminal groups that owe nothing retire, and closed update records no decider reads;
  workflows/state.py, workflows/reducer_update.retire_updates).

At step `--early` and at the last step each prints: live groups held, update records held, the state's size (msgpack
of `to_dict()`, what a snapshot stores), a decision tick (best of `--ticks`: every decider of `coordinator.decide`, each in full), `digest()`, and a
snapshot's work (`to_dict` + msgpack + digest, what events.snapshots.take_snapshot computes before its one XADD),
then the last/early ratio of each. The aim: every ratio of the bounded state <= 1.2. Timings are best-of, CPU-bound,
on whatever machine runs it (a shared machine's load moves them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgpack
import pytest
from bench_replay import RunWriter

from rolledger.schemas.events import Event
from rolledger.workflows import reducer_rollout, reducer_trainer, reducer_update
from rolledger.workflows.admission import AdmissionInputs, decide_admission
from rolledger.workflows.coordinator import decide_run_end, decide_terminal
from rolledger.workflows.groups import decide_groups
from rolledger.workflows.handoff import decide_handoff
from rolledger.workflows.reducer import fold
from rolledger.workflows.scheduler import PromptItem
from rolledger.workflows.state import RunState
from rolledger.workflows.update import decide_update

PROMPTS = [PromptItem(i, f"p{i}", tuple(range(2000, 2032)), "0") for i in range(1000)]


@dataclass
class Point:
    step: int
    events: int
    live_groups: int
    update_records: int
    state_bytes: int
    decide_ms: float
    digest_ms: float
    snapshot_ms: float


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1000


def tick(state: RunState, now: float, inputs: AdmissionInputs) -> int:
    """Every decider of coordinator.decide, each run in full (decide itself returns at the first that acts; the
    synthetic run trips its run deadline and its lag gate, which would cut the tick short)."""
    out = decide_terminal(state, now) + decide_update(state, now, 1) + decide_groups(state, now)
    out += decide_handoff(state) + decide_run_end(state) + decide_admission(state, inputs)
    return len(out) + state.lag


def measure(state: RunState, step: int, ticks: int) -> Point:
    now = state.last_wall_time
    inputs = AdmissionInputs(now=now, prompts=PROMPTS)
    packed = msgpack.packb(state.to_dict())
    return Point(
        step=step,
        events=state.events_applied,
        live_groups=len(state.groups),
        update_records=len(state.updates),
        state_bytes=len(packed),
        decide_ms=best_ms(lambda: tick(state, now, inputs), ticks),
        digest_ms=best_ms(state.digest, max(3, ticks // 4)),
        snapshot_ms=best_ms(lambda: (state.digest(), msgpack.packb(state.to_dict())), max(3, ticks // 4)),
    )


class Folder:
    """Folds each batch the writer hands it; measures at the steps asked for."""

    def __init__(self) -> None:
        self.state = RunState()

    def __call__(self, events: list[Event]) -> None:
        for e in events:
            self.state = fold(self.state, e)


def pipelined_step(
    writer: RunWriter, previous: list[tuple[str, tuple[str, ...], int]], groups: int
) -> list[tuple[str, tuple[str, ...], int]]:
    """Generate this step's groups, then consume the previous step's (RunWriter.step consumes its own at once)."""
    b = writer.b
    done = [writer.group(rank=i % b.config.ranks) for i in range(groups)]
    if previous:
        b.consume(
            [g for g, _, _ in previous],
            trajectory_ids=tuple(s for _, ids, _ in previous for s in ids),
            versions=tuple(v for _, _, v in previous),
        )
        for _, ids, _ in previous:
            for sid in ids:
                b._started.pop(sid, None)
                b._trajectories.pop(sid, None)
    return done


def retirement_off() -> AbstractContextManager[Any]:
    mp = pytest.MonkeyPatch()
    mp.setattr(reducer_rollout, "retire_if_done", lambda s, g: None)
    mp.setattr(reducer_trainer, "retire_if_done", lambda s, g: None)
    mp.setattr(reducer_update, "retire_updates", lambda s: None)

    class _Undo:
        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            mp.undo()

    return _Undo()


def run(args: argparse.Namespace, ctx: AbstractContextManager[Any]) -> tuple[Point, Point, float]:
    with ctx:
        folder = Folder()
        writer = RunWriter(folder, run_id="bench-state", group_size=args.group_size, ranks=args.ranks)
        writer.b.start_run()
        points: list[Point] = []
        fold_cpu = 0.0
        previous: list[tuple[str, tuple[str, ...], int]] = []
        for step in range(1, args.steps + 1):
            previous = pipelined_step(writer, previous, args.groups_per_step)
            if step % args.update_every == 0:
                writer.b.update()
            c = time.process_time()
            writer._flush(force=True)
            fold_cpu += time.process_time() - c
            if step in (args.early, args.steps):
                points.append(measure(folder.state, step, args.ticks))
        assert not folder.state.anomalies, folder.state.anomalies[:3]
    return points[0], points[1], fold_cpu / max(folder.state.events_applied, 1) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--early", type=int, default=2, help="the early step measured (step 1 is mostly start-up)")
    ap.add_argument("--groups-per-step", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--update-every", type=int, default=4)
    ap.add_argument("--ticks", type=int, default=20, help="decide() calls per measurement (best kept)")
    args = ap.parse_args()
    if not 1 <= args.early < args.steps:
        raise SystemExit("--early must be >= 1 and below --steps")
    load = os.getloadavg()
    print(
        f"{args.steps} steps x {args.groups_per_step} groups x {args.group_size} samples, {args.ranks} ranks; "
        f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    rows = []
    for label, ctx in (("baseline (no retirement)", retirement_off()), ("bounded", nullcontext())):
        early, last, fold_us = run(args, ctx)
        rows.append((label, early, last, fold_us))
    print(
        f"\n{'':<26} {'step':>5} {'events':>9} {'live groups':>11} {'updates':>7} {'state KiB':>10} {'decide ms':>10} "
        f"{'digest ms':>10} {'snapshot ms':>11}"
    )
    for label, early, last, fold_us in rows:
        for p in (early, last):
            print(
                f"{label:<26} {p.step:>5} {p.events:>9,} {p.live_groups:>11,} {p.update_records:>7,} "
                f"{p.state_bytes / 1024:>10.1f} "
                f"{p.decide_ms:>10.3f} {p.digest_ms:>10.3f} {p.snapshot_ms:>11.3f}"
            )
        ratio = {
            "live groups": last.live_groups / max(early.live_groups, 1),
            "state bytes": last.state_bytes / early.state_bytes,
            "decide": last.decide_ms / early.decide_ms,
            "digest": last.digest_ms / early.digest_ms,
            "snapshot": last.snapshot_ms / early.snapshot_ms,
        }
        print(
            f"{label:<26} last/early: "
            + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items())
            + f"; fold {fold_us:.1f} us/event (cpu)"
        )
    load = os.getloadavg()
    print(f"\nload average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (aim: bounded ratios <= 1.2x)")


if __name__ == "__main__":
    main()
