"""The `rolledger` command line (the contract of DESIGN.md): run, replay, audit, lineage, timeline, status,
coordinator, worker. Each subcommand is a thin edge over the modules that do the work."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, get_args

import structlog
from pydantic import ValidationError

from rolledger.schemas.config import RunConfig
from rolledger.schemas.statuses import RunStatus

if TYPE_CHECKING:  # the subcommands import what they use when they run: `rolledger --help` stays fast
    import redis

    from rolledger.events.scan import LogScan
    from rolledger.schemas.events import Event
    from rolledger.workflows.replay import ReplayReport


class CliError(Exception):
    """A refused input or a run that does not exist: `main` prints the message as one line and exits 2."""


class _CurrentStderr:
    """Writes to whatever sys.stderr is *now*: worker threads outlive a redirected stream (a test's capture, a
    closed pipe) and must not keep writing to the one that was current when logging was configured."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(json_logs: bool) -> None:
    """JSON logs for services (and when stderr is not a terminal), pretty ones in a terminal."""
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]  # wants TextIO; uses write/flush
    )


def _config_from_args(args: argparse.Namespace) -> RunConfig:
    data: dict[str, object] = {}
    if args.config:
        data = RunConfig.load(args.config).model_dump(exclude_unset=True)
    for field in ("engine", "ranks", "mode", "steps", "seed"):
        value = getattr(args, field, None)
        if value is not None:
            data[field] = value
    if getattr(args, "vllm_url", None):
        data["vllm_urls"] = tuple(args.vllm_url)
    return RunConfig.model_validate(data)


def cmd_run(args: argparse.Namespace) -> int:
    from rolledger.schemas.config import one_line
    from rolledger.schemas.injection import check_injections, parse_injection
    from rolledger.workers.local_run import LocalRun, RunOptions, RunRefused
    from rolledger.workers.progress import LiveProgress

    try:
        cfg = _config_from_args(args)
        injections = [parse_injection(s) for s in args.inject]
        check_injections(injections, cfg, in_process=not args.external_workers)
    except ValidationError as exc:
        print(f"rolledger run: invalid configuration: {one_line(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:  # ConfigError included: already one line naming the file and field
        print(f"rolledger run: invalid configuration: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    progress = LiveProgress()
    opts = RunOptions(
        config=cfg,
        redis_url=args.redis,
        run_id=args.run_id,
        runs_dir=Path(args.runs_dir),
        injections=injections,
        metrics_port=args.metrics_port,
        on_progress=lambda f: progress.update(f.state),
        on_warm_start=progress.warm_start(cfg.trainer.warm_start_steps),
        external_workers=args.external_workers,
        model_dir=Path(args.model_dir) if args.model_dir else None,
        resume=args.resume,
    )
    try:
        run = LocalRun(opts)
        with progress:
            summary = run.execute()
    except RunRefused as exc:
        print(f"rolledger run: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary.to_dict(), indent=2))
    from rolledger.workflows.incidents import render_incidents

    print("\n".join(render_incidents(summary.incidents)), file=sys.stderr)
    print(f"run {run.run_id}: {run.run_dir / 'summary.json'}", file=sys.stderr)
    if run.signalled is not None:
        return 128 + run.signalled
    return 0 if summary.status == RunStatus.COMPLETED else 1


@contextmanager
def _open(args: argparse.Namespace) -> Iterator[tuple[redis.Redis, str]]:
    """The run's Redis and id, for reading; a run that does not exist (no run directory and no Redis to look in, or
    a log with no entry) is a CliError, not an empty run that audits OK."""
    from rolledger.events.open_run import NoSuchRun, open_run
    from rolledger.events.redact import redact
    from rolledger.events.scan import log_exists

    try:
        with open_run(args.run, args.redis, Path(args.runs_dir)) as (client, run_id):
            if not log_exists(client, run_id):
                where = redact(args.redis or os.environ.get("REDIS_URL") or str(Path(args.runs_dir) / args.run))
                raise CliError(f"run {args.run!r} has no events (no log {run_id!r} at {where}): no such run")
            yield client, run_id
    except NoSuchRun as exc:
        raise CliError(str(exc)) from None


def _scan(client: redis.Redis, run_id: str, start: str = "-") -> LogScan:
    """The log, read without writing anything (undecodable entries are reported, not dead-lettered)."""
    from rolledger.events.scan import scan_log

    return scan_log(client, run_id, start)


def _verify(client: redis.Redis, run_id: str, until: str | None = None) -> tuple[ReplayReport, LogScan]:
    """The replay check over the run's log and its stored snapshots (read once each, read-only)."""
    from rolledger.events.snapshots import stored_snapshots
    from rolledger.workflows.replay import check_replay

    scan = _scan(client, run_id)
    return check_replay(scan.entries, stored_snapshots(client, run_id), until), scan


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
        "state": state.to_dict(),
    }
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        from rich.console import Console

        from rolledger.workers.progress import status_table

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
    return 0 if report.ok and not scan.undecodable else 1


def _events(client: redis.Redis, run_id: str) -> list[Event]:
    return [s.event for s in _scan(client, run_id).entries]


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
    )
    print(report.to_json() if args.json else report.render())
    return 0 if report.passed else 1


def cmd_lineage(args: argparse.Namespace) -> int:
    from rolledger.workflows.lineage import lineage

    with _open(args) as (client, run_id):
        events = _events(client, run_id)
    try:
        chain = lineage(events, args.trajectory_id)
    except KeyError as exc:
        print(f"rolledger lineage: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 1
    print(chain.to_json() if args.json else chain.render())
    return 0


def cmd_timeline(args: argparse.Namespace) -> int:
    from rolledger.workers.timeline_render import SUFFIXES, write_timeline
    from rolledger.workflows.timeline import build_timeline

    if Path(args.out).suffix not in SUFFIXES:  # refused before the run is opened
        print(f"rolledger timeline: --out must end in {' or '.join(SUFFIXES)}, not {args.out!r}", file=sys.stderr)
        return 2
    with _open(args) as (client, run_id):
        events = _events(client, run_id)
    out = Path(args.out)
    write_timeline(build_timeline(events), out)
    print(out)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rolledger.events.snapshots import latest_snapshot
    from rolledger.workers.progress import status_table
    from rolledger.workflows.replay import rebuild

    with _open(args) as (client, run_id):  # the latest snapshot plus the tail after it: fast on a long run
        snap = latest_snapshot(client, run_id)
        tail = _scan(client, run_id, "(" + snap.stream_id if snap else "-").entries
        state, _ = rebuild(tail, from_snapshot=snap)
    Console().print(status_table(state))
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    from rolledger.workers.ui_server import UiRefused, run_ui

    try:
        return run_ui(args.host, args.port, args.allow_remote, lambda: _open(args), _scan)
    except UiRefused as exc:
        raise CliError(str(exc)) from None


def cmd_coordinator(args: argparse.Namespace) -> int:
    from rolledger.workers.processes import run_coordinator

    return run_coordinator(args.redis, args.run)


def cmd_worker(args: argparse.Namespace) -> int:
    from rolledger.workers.processes import run_worker

    return run_worker(args.kind, args.redis, args.run, rank=args.rank, name=args.name, claim_idle_ms=args.claim_idle_ms)


def _choices(field: str) -> tuple[str, ...]:
    """The values a Literal field of RunConfig allows: one definition of e.g. the engines, the config's."""
    return get_args(RunConfig.model_fields[field].annotation)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rolledger", description=__doc__)
    parser.add_argument("--json-logs", action="store_true", help="structured JSON logs (default when not a terminal)")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the RL loop (embedded Redis and the torch engine by default)")
    run.add_argument("--config", help="TOML, JSON or YAML run config")
    run.add_argument(
        "--redis", help="Redis URL (redis://, rediss://, unix://); default: REDIS_URL or an embedded server"
    )
    run.add_argument("--engine", choices=_choices("engine"))
    run.add_argument("--ranks", type=int)
    run.add_argument("--mode", choices=_choices("mode"))
    run.add_argument("--steps", type=int)
    run.add_argument("--seed", type=int)
    run.add_argument("--run-id", help="[A-Za-z0-9][A-Za-z0-9._-]{0,127}; an existing one is refused without --resume")
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue an existing run id: reopen its log and start fresh workers that carry on from it",
    )
    run.add_argument("--runs-dir", default="runs")
    run.add_argument("--inject", action="append", default=[], metavar="SPEC", help="fault injection, see DESIGN.md")
    run.add_argument("--vllm-url", action="append", help="an already running vLLM server (one per rank)")
    run.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    run.add_argument(
        "--external-workers",
        action="store_true",
        help="start the run and follow it; the coordinator and workers run as their own processes "
        "(`rolledger coordinator`, `rolledger worker KIND`)",
    )
    run.add_argument(
        "--model-dir",
        help="an existing policy directory to start from (no warm start); "
        "with --external-workers every process must see the same path",
    )
    run.set_defaults(func=cmd_run)

    def run_ref(p: argparse.ArgumentParser) -> None:
        p.add_argument("run", metavar="RUN", help="run id or run directory")
        p.add_argument("--redis", help="Redis URL; default: REDIS_URL, the run directory's server or its AOF")
        p.add_argument("--runs-dir", default="runs")

    replay = sub.add_parser("replay", help="rebuild a run's state from its log; check snapshots and determinism")
    run_ref(replay)
    replay.add_argument("--until", metavar="EVENT_ID", help="stop after this event id (or stream id)")
    replay.add_argument("--json", action="store_true")
    replay.set_defaults(func=cmd_replay)

    audit = sub.add_parser("audit", help="check the invariants of DESIGN.md over a run's log (exit 1 on violations)")
    run_ref(audit)
    audit.add_argument("--json", action="store_true")
    audit.set_defaults(func=cmd_audit)

    lineage = sub.add_parser("lineage", help="the provenance chain of one trajectory")
    run_ref(lineage)
    lineage.add_argument("trajectory_id", metavar="TRAJECTORY_ID")
    lineage.add_argument("--json", action="store_true")
    lineage.set_defaults(func=cmd_lineage)

    timeline = sub.add_parser("timeline", help="draw the run: groups, updates, handoffs, bubbles")
    run_ref(timeline)
    timeline.add_argument("--out", required=True, help="FILE.png or FILE.html")
    timeline.set_defaults(func=cmd_timeline)

    from rolledger.workers.cli_events import register as register_events

    register_events(sub, run_ref)

    status = sub.add_parser("status", help="live state of a running run")
    run_ref(status)
    status.set_defaults(func=cmd_status)

    ui = sub.add_parser("ui", help="a live web page for one run, served from its log (loopback only by default)")
    run_ref(ui)
    ui.add_argument("--host", default="127.0.0.1", help="address to serve on (default: %(default)s)")
    ui.add_argument("--port", type=int, default=8765, help="port (default: %(default)s; 0: any free one)")
    ui.add_argument(
        "--allow-remote",
        action="store_true",
        help="serve on a non-loopback --host (the page has no authentication)",
    )
    ui.set_defaults(func=cmd_ui)

    coord = sub.add_parser("coordinator", help="run the coordinator process")
    coord.add_argument("--redis", required=True)
    coord.add_argument("--run", required=True)
    coord.set_defaults(func=cmd_coordinator)

    worker = sub.add_parser("worker", help="run one worker process")
    worker.add_argument("kind", choices=["rollout", "rank", "reward", "trainer"])
    worker.add_argument("--redis", required=True)
    worker.add_argument("--run", required=True)
    worker.add_argument("--rank", type=int, default=0, help="rank of a rollout/rank worker")
    worker.add_argument("--name", help="consumer name (default: KIND-RANK or KIND)")
    worker.add_argument(
        "--claim-idle-ms",
        type=int,
        default=None,
        help="reclaim work whose owner missed its heartbeats this long (ms; default: the run's recovery.lost_after_s)",
    )
    worker.set_defaults(func=cmd_worker)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.json_logs or not sys.stderr.isatty() and os.environ.get("ROLLEDGER_PRETTY_LOGS") is None)
    try:
        code: int = args.func(args)
    except CliError as exc:
        print(f"rolledger {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `rolledger audit RUN | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except Exception as exc:
        from rolledger.events.connection import RedisUnavailable  # (imported late: `rolledger --help` stays fast)

        if not isinstance(exc, RedisUnavailable):
            raise
        print(f"rolledger {args.command}: {exc}", file=sys.stderr)  # the outage outlasted the retry deadline
        return 3
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
