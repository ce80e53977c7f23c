"""The `rolledger` command line: run, replay, audit, lineage, timeline, events, status, ui, coordinator, worker.
Each subcommand is a thin edge over the modules that do the work: the parser is cli_parser.py, the commands that run
something cli_run.py, those that read a run back cli_read.py and cli_events.py, the exit codes cli_errors.py; this
module is the entry point (`main`): logging, and every error as one line with its exit code.

Every error of the command line is one line on stderr naming the thing (file, field, option, run) with a hint where
one helps, and a documented exit code (`EXIT_CODES`). Options and configs are checked before anything heavy is
imported (torch, transformers, matplotlib, vllm): each subcommand imports what it uses only once its inputs are valid.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import structlog

from rolledger.workers.operator.cli_errors import EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE, CliError
from rolledger.workers.operator.cli_parser import build_parser


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
        from rolledger.events.refusal import refusal_line  # (imported late: `rolledger --help` stays fast)

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
    from rolledger.events.outage import waiting_notice

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
