"""Run N chaos schedules and print the counts: `python -m tests.chaos.run_chaos --schedules 200 --seed S`.

`--soak M` runs one long run of M minutes under a steady rate of faults instead, its memory sampled and checked flat
(tests/chaos/soak.py; `--fault-every S`, `--sample-every S`).

Schedule i has seed S+i (drawn by `schedule.draw`), so `--seed S+i --schedules 1` replays it; `--schedule JSON` runs
one printed schedule as is. `--faults none` runs fault-free schedules (they must all finish); `--faults kill,stop`
draws only those kinds; `--faults net` only network faults (1 to --max-faults a schedule, through each process's
fault proxy), `--transports dist` the dist transport (whose schedules also draw kill-trainer@copy and
kill-rank=R@receive beside the other injections). `--parallel 2` runs two schedules at once (each has its own redis-server and directory).

Before it, one line counts the faults that fired by kind (`faults fired by kind: kill 3, net:partition 1, inject:
kill-rank 1, ...`: an injection by its --inject kind, a network fault by its kind). The last line is the summary:
    schedules N, faults injected F, runs finished A, runs failed-closed B, violations V, events lost L
F counts faults that fired (signals sent, Redis stopped, armed injections that their process fired); V counts
schedules with at least one violation other than lost events; L counts acknowledged event ids missing from the log.
Each failing schedule is printed as it ends, with its findings, its seed and the command that replays it; its\ndirectory (logs, ack files, the Redis AOF, result.json) is kept.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .checks import Ending, summary_line
from .harness import Result, prepare_model, run_schedule
from .schedule import ROLLOUT_CHOICES, FaultKind, Schedule, draw, parse_choices, parse_kinds, parse_transports


def fired_kind(fired: str) -> str:
    """The kind of one `Result.faults_fired` entry: `inject <spec>` -> inject:<its kind>, `t+Ns net:<proc>:<kind>:S`
    -> net:<kind>, `t+Ns <kind>:...` -> <kind>."""
    if fired.startswith("inject "):
        return "inject:" + re.split(r"[=@]", fired.split(" ", 1)[1], maxsplit=1)[0]
    fault = fired.split(" ", 1)[1] if fired.startswith("t+") else fired
    parts = fault.split(":")
    return f"net:{parts[2]}" if parts[0] == "net" and len(parts) > 2 else parts[0]


@dataclass
class Totals:
    schedules: int = 0
    faults: int = 0
    finished: int = 0
    failed_closed: int = 0
    violations: int = 0
    lost: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)

    def add(self, r: Result) -> None:
        self.schedules += 1
        self.faults += len(r.faults_fired)
        self.by_kind.update(fired_kind(f) for f in r.faults_fired)
        self.finished += r.verdict.ending is Ending.FINISHED
        self.failed_closed += r.verdict.ending is Ending.FAILED_CLOSED
        self.violations += bool(r.verdict.violations)
        self.lost += len(r.verdict.lost)

    def kinds_line(self) -> str:
        return "faults fired by kind: " + (", ".join(f"{k} {n}" for k, n in sorted(self.by_kind.items())) or "none")

    def line(self) -> str:
        return summary_line(self.schedules, self.faults, self.finished, self.failed_closed, self.violations, self.lost)


def replay_command(seed: int, faults: str) -> str:
    cmd = [".venv/bin/python", "-m", "tests.chaos.run_chaos", "--seed", str(seed), "--schedules", "1", "--keep"]
    if faults != "all":
        cmd += ["--faults", faults]
    return shlex.join(cmd)


def describe(r: Result, faults: str) -> str:
    v = r.verdict
    lines = [
        (
            f"FAILED schedule seed {r.schedule.seed} ({v.ending}{': ' + v.reason if v.reason else ''}, "
            f"{r.events} events, {r.acks} acks, {r.wall_s:.0f} s; kept in {r.workdir})"
        ),
        *(f"  schedule: {x}" for x in r.schedule.render().splitlines()),
        *(f"  fired: {f}" for f in r.faults_fired),
        *(f"  not fired: {f}" for f in r.faults_not_fired),
        *(f"  violation: {x}" for x in v.violations),
        *(f"  lost: {a.event_id} {a.type} (acknowledged to {a.process}, stream id {a.stream_id})" for a in v.lost[:20]),
        *(f"  crash: {c.splitlines()[0]}" for c in r.crashes),
        f"  replay: {replay_command(r.schedule.seed, faults)}",
        f"  schedule json: {r.schedule.to_json()}",
    ]
    return "\n".join(lines)


_NUMBERS = re.compile(r"\b(?:[0-9a-f]{8,}|[0-9A-Z]{26}|g\d+/\d+|g\d+|v?\d+(?:\.\d+)?)\b")


def _last_error(log_tail: Sequence[str]) -> str:
    """The last line of a crashed process's log that names an exception or an error event."""
    for line in reversed(log_tail):
        if "Error" in line or "Exception" in line or '"error"' in line or "SystemExit" in line:
            return line.strip()[-200:]
    return ""


def failure_kind(violation: str) -> str:
    """A violation with its ids, digests and numbers blanked: what groups schedules that failed the same way."""
    return _NUMBERS.sub("#", violation.split(":\n")[0])[:110]


def failure_kinds(results: Sequence[Result]) -> list[str]:
    """One line per kind of violation (and of crash): how many schedules, and their seeds."""
    kinds: dict[str, list[int]] = {}
    for r in results:
        seen = {failure_kind(v) for v in r.verdict.violations}
        seen |= {"lost: acknowledged " + a.type + " missing from the log" for a in r.verdict.lost}
        seen |= {"crash (restarted): " + failure_kind(c.splitlines()[0].split(" ", 1)[1]) for c in r.crashes}
        for k in seen:
            kinds.setdefault(k, []).append(r.schedule.seed)
    return [f"  {len(seeds)} x {k}  (seeds {', '.join(map(str, seeds[:12]))})" for k, seeds in sorted(kinds.items())]


def run_many(
    schedules: Sequence[Schedule],
    workdir: Path,
    *,
    parallel: int = 1,
    keep: bool = False,
    faults: str = "all",
    out: Callable[[str], None] = print,
    run_deadline_s: float = 60.0,
    deadline_is_violation: bool = True,
) -> tuple[Totals, list[Result]]:
    """Run `schedules` (at most `parallel` at once); print one line per schedule, and the findings of failing ones."""
    models = {"plain": prepare_model(workdir / "model")}
    models["many"] = models["plain"]  # short samples as plain: what it tries is the concurrency and the engine process
    long = {s.rollout for s in schedules} - {"plain", "many"}
    if long:  # a policy never warm-started: samples run tens of tokens
        unwarmed = prepare_model(workdir / "model-unwarmed", warm_start_steps=0)
        models.update(dict.fromkeys(long, unwarmed))
    totals = Totals()
    results: list[Result] = []

    def one(s: Schedule) -> Result:
        return run_schedule(
            s,
            workdir / f"s{s.seed}",
            models[s.rollout],
            keep=keep,
            run_deadline_s=run_deadline_s,
            deadline_is_violation=deadline_is_violation,
        )

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        for r in pool.map(one, schedules):
            totals.add(r)
            results.append(r)
            v = r.verdict
            status = "ok" if r.ok else "FAIL"
            out(
                f"[{status}] seed {r.schedule.seed}: {v.ending}{' (' + v.reason + ')' if v.reason else ''}, "
                f"{len(r.faults_fired)} faults fired, {len(v.violations)} violations, {len(v.lost)} lost, "
                f"{len(r.crashes)} crashes, {r.wall_s:.1f} s"
            )
            if not r.ok:
                out(describe(r, faults))
            else:  # a process that exited by itself and was restarted is no violation, but worth a line
                for c in r.crashes:
                    lines = c.splitlines()
                    out(f"  crash (restarted): {lines[0]} {_last_error(lines[1:])}")
            sys.stdout.flush()
    kinds = failure_kinds(results)
    if kinds:
        out("failure kinds:")
        for k in kinds:
            out(k)
    out(totals.kinds_line())
    out(totals.line())
    return totals, results


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.chaos.run_chaos", description=__doc__.split("\n")[0])
    ap.add_argument("--schedules", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="schedule i has seed SEED+i")
    ap.add_argument(
        "--faults",
        default="all",
        help="all, none, or a comma list of kill,stop,freeze,slow,redis-term,redis-kill,inject,net (net: network "
        "faults between one process and Redis, drawn beside the others from their own generator)",
    )
    ap.add_argument("--max-faults", type=int, default=3, help="faults per schedule: 1 to this many")
    ap.add_argument(
        "--transports",
        default="directory",
        help="weight transports the schedules draw from: directory (default), dist, or directory,dist",
    )
    ap.add_argument(
        "--rollouts",
        default="plain,recycle",
        help="rollouts the schedules draw from: plain (short samples, wait drains), recycle (abort drains, samples "
        "long enough to be cut, recycle_aborted), interruptible (keep drains: samples long enough to be parked, "
        "continued on the new version), many (3 groups in flight per rank, 2 a decode step, each rank's torch "
        "engine in a process of its own: torch_engine.process), as a comma list; default plain,recycle",
    )
    ap.add_argument("--schedule", help="run this one printed schedule (its JSON) instead of drawing")
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--workdir", help="where schedules run (default: a fresh temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the directories of passing schedules too")
    ap.add_argument("--run-deadline", type=float, default=60.0, help="the runs' run_deadline_s")
    ap.add_argument(
        "--allow-deadline",
        action="store_true",
        help="count a run ended by its run deadline as failed closed (default: it stalled, a violation)",
    )
    ap.add_argument("--print-only", action="store_true", help="print the schedules and exit")
    ap.add_argument(
        "--soak",
        type=float,
        metavar="MINUTES",
        help="instead of schedules: one run of MINUTES (fractions too) under a steady rate of faults, process RSS and "
        "Redis used_memory sampled, checked flat (tests/chaos/soak.py)",
    )
    ap.add_argument("--fault-every", type=float, default=30.0, help="--soak: seconds between faults (default 30)")
    ap.add_argument(
        "--sample-every", type=float, default=60.0, help="--soak: seconds between memory samples (default 60)"
    )
    args = ap.parse_args(argv)
    if args.soak is not None:
        from .soak import run_soak

        workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="rolledger-soak-"))
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            report = run_soak(
                args.soak, workdir, seed=args.seed, fault_every_s=args.fault_every, sample_every_s=args.sample_every
            )
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        return 0 if report.ok else 1
    try:
        kinds: tuple[FaultKind, ...] = parse_kinds(args.faults)
        transports = parse_transports(args.transports)
        rollouts = parse_choices("--rollouts", args.rollouts, ROLLOUT_CHOICES)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.schedule:
        schedules = [Schedule.from_json(args.schedule)]
    else:
        schedules = [draw(args.seed + i, kinds, args.max_faults, transports, rollouts) for i in range(args.schedules)]
    for s in schedules:
        print(s.render())
    if args.print_only:
        return 0
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="rolledger-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"workdir {workdir}")
    start = time.monotonic()
    totals, _ = run_many(
        schedules,
        workdir,
        parallel=args.parallel,
        keep=args.keep,
        faults=args.faults,
        run_deadline_s=args.run_deadline,
        deadline_is_violation=not args.allow_deadline,
    )
    print(f"({time.monotonic() - start:.0f} s)", file=sys.stderr)
    return 0 if totals.violations == 0 and totals.lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
