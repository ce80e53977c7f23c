"""README.md's figures, regenerated from real runs instead of typed in.

Runs `rolledger run` with the default config and seed 0 (what `./dev run` does), audits it, and renders the block
README.md holds between the two markers below from the run's summary.json: the reward pair
(`workflows.figures.reward_edges`, the one definition every view prints), steps and updates, lag against its cap,
logprob agreement, engine idle fraction, the queue's predicted and measured figures, the audit's verdict, and the
machine and commit it ran on. With `--runs N` it runs N times and prints each figure's range: the roles are threads
of one process, so two runs with the same seed interleave groups differently and their figures, events and digests
differ a little.

    python bench/readme_figures.py                  # run once, print the block it would write
    python bench/readme_figures.py --write          # ... and rewrite README.md between the markers
    python bench/readme_figures.py --runs 2         # two runs: ranges, the spread between runs of one seed
    python bench/readme_figures.py --summary runs/ID/summary.json   # from existing runs' summaries, no run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BEGIN = "<!-- figures:begin -->"
END = "<!-- figures:end -->"
ROOT = Path(__file__).resolve().parent.parent
SEED = 0


class MarkersMissing(Exception):
    """README.md does not hold the two markers (in order) that delimit the figures block."""


def run_once(runs_dir: Path, run_id: str) -> dict[str, Any]:
    """One `rolledger run --seed 0` with the default config (its progress goes to this console), then its audit;
    the summary with the audit's verdict added as `audit`."""
    cli = [sys.executable, "-m", "rolledger.workers.operator.cli"]
    where = ["--runs-dir", str(runs_dir)]
    subprocess.run([*cli, "run", "--seed", str(SEED), "--run-id", run_id, *where], check=True, stdout=sys.stderr)
    summary: dict[str, Any] = json.loads((runs_dir / run_id / "summary.json").read_text())
    audited = subprocess.run([*cli, "audit", run_id, *where, "--json"], check=False, capture_output=True, text=True)
    summary["audit"] = json.loads(audited.stdout)["verdict"] if audited.stdout.strip() else f"exit {audited.returncode}"
    return summary


def machine() -> str:
    """The CPU, its core count, the commit and the date: where the figures come from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "?"
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    return f"{cpu}, {os.cpu_count()} cores, commit {commit}, {today}"


def _span(values: Sequence[float], fmt: str) -> str:
    """One value, or `low-high` when the runs differ."""
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}-{format(hi, fmt)}"


def render_block(summaries: Sequence[dict[str, Any]], where: str) -> str:
    """The README block (markers included) for one or more summaries of the same config and seed."""
    from rolledger.workflows.figures import REWARD_EDGES_LABEL

    def col(key: str) -> list[float]:
        return [float(s[key]) for s in summaries]

    def queue(key: str) -> list[float]:
        return [float(s["queue_check"][key]) for s in summaries if s["queue_check"].get(key) is not None]

    def opt(values: list[float], fmt: str) -> str:
        return _span(values, fmt) if values else "-"

    n = len(summaries)
    audits = sorted({str(s.get("audit", "not run")) for s in summaries})
    reward = f"{_span(col('reward_first'), '.3f')} -> {_span(col('reward_last'), '.3f')}"
    updates = f"{_span(col('updates_committed'), '.0f')}/{_span(col('updates_aborted'), '.0f')}"
    mean_queue = (
        f"predicted mean {opt(queue('predicted_mean_queue_groups'), '.2f')}, "
        f"measured {opt(queue('measured_mean_queue_groups'), '.2f')}"
    )
    max_queue = f"max {opt(queue('measured_max_queue_groups'), '.0f')}"
    cap = f"(throttle cap {opt(queue('throttle_cap_groups'), '.0f')})"
    rows: list[tuple[str, str, str]] = [  # (figure, value, what it is)
        ("reward_first -> reward_last", reward, f"({REWARD_EDGES_LABEL})"),
        ("steps, updates committed/aborted", f"{_span(col('steps'), '.0f')}, {updates}", ""),
        ("max_lag", _span(col("max_lag"), ".0f"), "(the largest lag consumed; the cap is admission.max_lag)"),
        (
            "logprob_agreement",
            _span(col("logprob_agreement"), ".2g"),
            "(median |trainer - engine| logprob gap on on-policy tokens)",
        ),
        (
            "engine_idle_fraction",
            _span(col("engine_idle_fraction"), ".2f"),
            "(wall time the engines were not generating, mean over ranks)",
        ),
        ("queue, groups", f"{mean_queue}; {max_queue}", cap),
        ("anomalies", f"{_span(col('anomalies'), '.0f')}; audit {', '.join(audits)}", ""),
        ("wall_s, events", f"{_span(col('wall_s'), '.0f')} s, {_span(col('events'), '.0f')}", ""),
    ]
    lines = [f"{name}  {value}  {note}".rstrip() for name, value, note in rows]
    runs = "one run" if n == 1 else f"{n} runs (ranges: the roles are threads, so runs of one seed differ a little)"
    head = (
        f"What `./dev run` prints at the end (default config, seed {SEED}; {runs}; {where}), regenerated by "
        "`python bench/readme_figures.py --write`:"
    )
    return "\n".join([BEGIN, head, "", "```", *lines, "```", END])


def replace_block(text: str, block: str) -> str:
    """`text` with everything from BEGIN to END (inclusive) replaced by `block`."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise MarkersMissing(f"README.md has no {BEGIN} ... {END} pair; add the two markers where the figures go")
    return text[:start] + block + text[end + len(END) :]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1, help="how many runs of seed 0 (default 1)")
    ap.add_argument("--summary", action="append", default=[], help="an existing summary.json (no run); repeatable")
    ap.add_argument("--write", action="store_true", help="rewrite README.md between the markers")
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    args = ap.parse_args(argv)
    if args.summary:
        summaries = [json.loads(Path(p).read_text()) for p in args.summary]
    else:
        with tempfile.TemporaryDirectory(prefix="readme-figures-") as tmp:
            summaries = [run_once(Path(tmp), f"readme-figures-{i}") for i in range(args.runs)]
    block = render_block(summaries, machine())
    print(block)
    if args.write:
        readme = Path(args.readme)
        try:
            readme.write_text(replace_block(readme.read_text(), block))
        except MarkersMissing as exc:
            print(f"readme_figures: {exc}", file=sys.stderr)
            return 2
        print(f"readme_figures: {readme} rewritten", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
