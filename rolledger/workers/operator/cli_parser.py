"""The `rolledger` argument parser: every subcommand's options, help and epilog, on an argparse with one-line
errors and "did you mean" hints. Building it imports only the light command modules (the commands import what is
heavy when they run), so `rolledger --help` stays fast.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable
from typing import NoReturn, get_args

from rolledger.schemas import injection
from rolledger.schemas.config import RunConfig, UpdateConfig
from rolledger.workers.operator.cli_errors import EXIT_CODES, EXIT_USAGE
from rolledger.workers.operator.cli_read import cmd_audit, cmd_lineage, cmd_replay, cmd_status, cmd_timeline, cmd_ui
from rolledger.workers.operator.cli_run import cmd_coordinator, cmd_run, cmd_worker
from rolledger.workers.policy.checkpoints import SUPPORTED_ARCHITECTURES
from rolledger.workers.policy.run_inputs import REDIS_FSYNC, RUNS_ENV, default_runs_dir

DESCRIPTION = """\
The control plane of an asynchronous RL loop, event-sourced on Redis Streams: `run` runs it; `replay`, `audit`,
`lineage`, `timeline` and `status` read a run back from its log. `rolledger COMMAND --help` lists a command's
options. Errors are one line naming the thing, with the exit codes below."""


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
