"""The commands that read a run back from its log: replay, audit, lineage, timeline, status, ui (and, in
cli_events.py, events). `_open` resolves the run and refuses one that does not exist; `_scan` reads its archived
segments and live stream without writing anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from rolledger.workers.operator.cli_errors import EXIT_OK, EXIT_VIOLATED, CliError
from rolledger.workers.policy.run_inputs import RUNS_DIR_HELP

if TYPE_CHECKING:  # the commands import what they use when they run: `rolledger --help` stays fast
    import redis

    from rolledger.events.archive import RunScan
    from rolledger.schemas.events import Event
    from rolledger.workflows.replay import ReplayReport


# Where the run being read keeps its archived segments (`<run dir>/archive`), set by `_open` for `_scan`; None: the
# directory the archive manifest recorded.
_ARCHIVE_DIR: ContextVar[Path | None] = ContextVar("archive_dir", default=None)


@contextmanager
def _open(args: argparse.Namespace) -> Iterator[tuple[redis.Redis, str]]:
    """The run's Redis and id, for reading; a run that does not exist (no run directory and no Redis to look in, or
    a log with no entry) is a CliError, not an empty run that audits OK."""
    from rolledger.events.archive import archive_dir, read_manifest
    from rolledger.events.open_run import NoSuchRun, open_run, resolve
    from rolledger.events.redact import redact
    from rolledger.events.scan import log_exists

    run_dir = resolve(args.run, Path(args.runs_dir)).run_dir
    token = _ARCHIVE_DIR.set(archive_dir(run_dir) if run_dir is not None else None)
    try:
        with open_run(args.run, args.redis, Path(args.runs_dir)) as (client, run_id):
            if not log_exists(client, run_id) and not read_manifest(client, run_id).segments:
                where = redact(args.redis or os.environ.get("REDIS_URL") or str(Path(args.runs_dir) / args.run))
                raise CliError(f"run {args.run!r} has no events (no log {run_id!r} at {where}): no such run")
            yield client, run_id
    except NoSuchRun as exc:
        raise CliError(f"{exc}; the runs directory is {RUNS_DIR_HELP}") from None
    finally:
        _ARCHIVE_DIR.reset(token)


def _scan(client: redis.Redis, run_id: str, start: str = "-") -> RunScan:
    """The log, archived segments then the live stream, read without writing anything (undecodable entries are
    reported, not dead-lettered; a missing or tampered segment is in `problems`, named by its ids)."""
    from rolledger.events.archive import scan_run

    return scan_run(client, run_id, _ARCHIVE_DIR.get(), start)


def _report_segments(scan: RunScan, command: str) -> int:
    """Each segment problem as one stderr line; EXIT_VIOLATED if there was any (the log read is not whole)."""
    for p in scan.problems:
        print(f"rolledger {command}: {p.line()}", file=sys.stderr)
    return EXIT_VIOLATED if scan.problems else EXIT_OK


def _verify(client: redis.Redis, run_id: str, until: str | None = None) -> tuple[ReplayReport, RunScan]:
    """The replay check over the run's log and its stored snapshots (read once each, read-only)."""
    from rolledger.events.snapshots import stored_snapshots
    from rolledger.workflows.replay import check_replay

    scan = _scan(client, run_id)
    snapshots = stored_snapshots(client, run_id)
    try:
        return check_replay(scan.entries, snapshots, until), scan
    except Exception:  # a fold that fails on a log with a hole is reported, not raised
        if not scan.problems:
            raise
    # A missing or tampered archive segment leaves a hole the reducer may not fold past (a group completed whose
    # admission is gone): replay the whole part before the first hole; the problems make the command fail.
    from rolledger.events.archive import position

    hole = min(position(p.first_id) for p in scan.problems)
    structlog.get_logger("replay").warning("log has a hole: replayed up to the first missing segment only")
    prefix = [s for s in scan.entries if position(s.stream_id) < hole]
    return check_replay(prefix, snapshots, until), scan


def cmd_replay(args: argparse.Namespace) -> int:
    with _open(args) as (client, run_id):
        report, scan = _verify(client, run_id, until=args.until)
    state = report.state
    out = {
        "run_id": run_id,
        "digest": report.digest,
        "deterministic": report.digest == report.digest_again,
        "snapshot_plus_tail": report.tail_digest,
        "last_stream_id": report.last_stream_id,
        "snapshots": [
            {"event_id": e, "recorded": a, "replayed": b, "ok": a == b} for e, a, b in report.snapshot_checks
        ],
        "undecodable": [{"stream_id": u.stream_id, "type": u.event_type, "reason": u.reason} for u in scan.undecodable],
        "archive_problems": [{"first_id": p.first_id, "last_id": p.last_id, "reason": p.reason} for p in scan.problems],
        "state": state.to_dict(),
    }
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        from rich.console import Console

        from rolledger.workers.operator.progress import status_table

        Console().print(status_table(state))
        print(f"digest {report.digest} (replayed twice: {'same' if out['deterministic'] else 'DIFFERENT'})")
        bad = [(e, rec, rep) for e, rec, rep in report.snapshot_checks if rec != rep]
        print(f"snapshots checked: {len(report.snapshot_checks)}, mismatched: {len(bad)}")
        if report.tail_digest is not None:
            same = "same" if report.tail_digest == report.digest else f"DIFFERENT: {report.tail_digest}"
            print(f"latest snapshot + tail: {same}")
        for event_id, recorded, replayed in bad:
            print(f"  snapshot at {event_id}: recorded {recorded} != replayed {replayed}")
        print(f"anomalies: {len(state.anomalies)}")
        for a in state.anomalies[:20]:
            print(f"  {a.event_id} {a.event_type}: {a.message}")
        print(f"undecodable entries (not replayed): {len(scan.undecodable)}")
        for u in scan.undecodable[:20]:
            print(f"  {u.stream_id} {u.event_type or '?'}: {u.reason}")
        print(f"archive problems (entries not replayed): {len(scan.problems)}")
        for p in scan.problems:
            print(f"  {p.line()}")
    return 0 if report.ok and not scan.undecodable and not scan.problems else 1


def _events(client: redis.Redis, run_id: str, command: str) -> tuple[list[Event], int]:
    """The run's events (archive + live) and the exit code its segment problems call for (each one a stderr line)."""
    scan = _scan(client, run_id)
    return [s.event for s in scan.entries], _report_segments(scan, command)


def cmd_audit(args: argparse.Namespace) -> int:
    from rolledger.events.scan import read_dead_letters
    from rolledger.workflows.audit import audit

    with _open(args) as (client, run_id):
        rep, scan = _verify(client, run_id)
        dead = read_dead_letters(client, run_id)
    report = audit(
        (s.event for s in scan.entries),
        replay_digests=(rep.digest, rep.digest_again),
        snapshot_checks=rep.snapshot_checks,
        undecodable=scan.undecodable,
        dead_letters=dead,
        log_gaps=[(p.first_id, p.last_id, p.reason) for p in scan.problems],
    )
    print(report.to_json() if args.json else report.render())
    return 0 if report.passed else 1


def cmd_lineage(args: argparse.Namespace) -> int:
    from rolledger.workflows.lineage import lineage

    with _open(args) as (client, run_id):
        events, code = _events(client, run_id, "lineage")
    try:
        chain = lineage(events, args.trajectory_id)
    except KeyError as exc:  # a trajectory the run does not have: an input error
        raise CliError(str(exc.args[0] if exc.args else exc)) from None
    print(chain.to_json() if args.json else chain.render())
    return code


def cmd_timeline(args: argparse.Namespace) -> int:
    from rolledger.workers.operator.timeline_render import SUFFIXES, write_timeline
    from rolledger.workflows.timeline import build_timeline

    if Path(args.out).suffix not in SUFFIXES:  # refused before the run is opened
        raise CliError(f"--out must end in {' or '.join(SUFFIXES)}, not {args.out!r}")
    with _open(args) as (client, run_id):
        events, code = _events(client, run_id, "timeline")
    out = Path(args.out)
    write_timeline(build_timeline(events), out)
    print(out)
    return code


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rolledger.events.snapshots import latest_snapshot
    from rolledger.workers.operator.progress import status_table
    from rolledger.workflows.replay import rebuild

    with _open(args) as (client, run_id):  # the latest snapshot plus the tail after it: fast on a long run
        snap = latest_snapshot(client, run_id)
        tail = _scan(client, run_id, "(" + snap.stream_id if snap else "-").entries
        state, _ = rebuild(tail, from_snapshot=snap)
    Console().print(status_table(state))
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    from rolledger.workers.operator.ui_server import UiRefused, run_ui

    try:
        return run_ui(args.host, args.port, args.allow_remote, lambda: _open(args), _scan, token_file=args.token_file)
    except UiRefused as exc:
        raise CliError(str(exc)) from None
