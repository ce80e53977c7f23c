"""Colocated versus disaggregated on the same workload, in one run of this script.

For each mode: a full `rolledger run` (embedded Redis, torch engine, the same config and seed), then from its log:
rollout-idle fraction (summary.engine_idle_fraction: wall time the engines were not generating, for any reason),
trainer-idle fraction (wall time the trainer was not in a step), generated tokens/s, and in colocated mode the
handoff tax (summary.handoff_tax: wall time the engines were handed to the trainer, EngineSlept -> EngineResumed).
Printed side by side with the ratios, and the colocated handoff tax next to the 10-20% that published analyses of
colocated RL estimate.

    python bench/bench_modes.py [--steps 20] [--ranks 1]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.workers.operator.local_run import LocalRun, RunOptions


def measure(mode: str, steps: int, ranks: int, root: Path) -> dict[str, float]:
    cfg = RunConfig.model_validate({"mode": mode, "steps": steps, "ranks": ranks})
    run = LocalRun(RunOptions(config=cfg, runs_dir=root, run_id=f"bench-{mode}"))
    holder: dict[str, list[ev.Event]] = {}
    summary = run.execute(keep_events=holder)
    events = holder["events"]
    wall = summary.wall_s
    train_s = sum(e.payload.train_ms for e in events if isinstance(e.payload, ev.TrainStepFinished)) / 1e3
    tokens = sum(len(e.payload.trajectory.token_ids) for e in events if isinstance(e.payload, ev.SampleFinished))
    return {
        "wall_s": wall,
        "rollout_idle": summary.engine_idle_fraction,
        "handoff_tax": summary.handoff_tax if summary.handoff_tax is not None else 0.0,
        "trainer_idle": 1 - min(train_s / wall, 1.0),
        "tokens_per_s": tokens / wall,
        "reward_last": summary.reward_last,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dis = measure("disaggregated", args.steps, args.ranks, Path(tmp))
        col = measure("colocated", args.steps, args.ranks, Path(tmp))
    print(f"{'':22}{'disaggregated':>15}{'colocated':>12}{'colo/disagg':>13}")
    for k in ("wall_s", "rollout_idle", "trainer_idle", "tokens_per_s", "reward_last"):
        ratio = col[k] / dis[k] if dis[k] else float("nan")
        print(f"{k:22}{dis[k]:>15.3f}{col[k]:>12.3f}{ratio:>13.2f}")
    print(f"colocated handoff tax {col['handoff_tax']:.1%} (published estimates for colocated RL: 10-20%)")


if __name__ == "__main__":
    main()
