"""Every `--inject` scenario on one short run: how the run ended, updates committed/aborted, and the audit.

    python bench/inject_matrix.py [--steps 3] [--ranks 2] [--out table.json]

Runs `rolledger run` once per scenario (embedded Redis, torch engine, a short warm start), then `rolledger audit`
on it, and prints one row each. Used to check that a refactoring keeps every scenario's outcome: run it before and
after on the same machine and compare the rows (the JSON output is for that).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SCENARIOS = (
    "",
    "fail-rank=1@prepare",
    "fail-rank=1@transfer",
    "fail-rank=1@commit",
    "corrupt-rank=1",
    "stale-weights=1",
    "kill-worker=rollout@2",
    "kill-worker=reward@3",
    "kill-worker=trainer@1",
    "kill-worker=coordinator@5",
    "delay-trainer=1",
)

CONFIG = """ranks = {ranks}
steps = {steps}
group_size = 4
[trainer]
warm_start_steps = 100
groups_per_step = 2
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rolledger = Path(sys.executable).with_name("rolledger")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "run.toml"
        cfg.write_text(CONFIG.format(ranks=args.ranks, steps=args.steps))
        for i, spec in enumerate(SCENARIOS):
            run_id = f"matrix-{i}"
            cmd = [str(rolledger), "run", "--config", str(cfg), "--runs-dir", tmp, "--run-id", run_id]
            cmd += ["--inject", spec] if spec else []
            subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
            summary_file = Path(tmp) / run_id / "summary.json"
            summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
            audit = subprocess.run(
                [str(rolledger), "audit", "--runs-dir", tmp, run_id],
                check=False,
                capture_output=True,
                text=True,
                timeout=300,
            )
            row = {
                "inject": spec or "(none)",
                "status": summary.get("status", "no summary"),
                "committed": summary.get("updates_committed"),
                "aborted": summary.get("updates_aborted"),
                "steps": summary.get("steps"),
                "audit": "ok" if audit.returncode == 0 else f"exit {audit.returncode}",
            }
            rows.append(row)
            print(
                f"{row['inject']:<28} {row['status']:<10} committed {row['committed']!s:>3}  "
                f"aborted {row['aborted']!s:>3}  steps {row['steps']!s:>3}  audit {row['audit']}",
                flush=True,
            )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
