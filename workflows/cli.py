"""The `rolledger` command line (the contract of DESIGN.md): run, replay, audit, lineage, timeline, status,
coordinator, worker. Each subcommand is a thin edge over the modules that do the work."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import structlog
from pydantic import ValidationError

from schemas.config import RunConfig


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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
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
    from workers.local_run import LocalRun, RunOptions
    from workflows.inject import parse_injection
    from workflows.progress import LiveProgress

    try:
        cfg = _config_from_args(args)
        injections = [parse_injection(s) for s in args.inject]
    except (ValidationError, ValueError) as exc:
        print(f"rolledger run: invalid configuration: {exc}", file=sys.stderr)
        return 2
    progress = LiveProgress()
    opts = RunOptions(config=cfg, redis_url=args.redis, run_id=args.run_id, runs_dir=Path(args.runs_dir),
                      injections=injections, on_progress=lambda f: progress.update(f.state))  # fmt: skip
    run = LocalRun(opts)
    with progress:
        summary = run.execute()
    print(json.dumps(summary.to_dict(), indent=2))
    print(f"run {run.run_id}: {run.run_dir / 'summary.json'}", file=sys.stderr)
    return 0 if summary.status == "completed" else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rolledger", description=__doc__)
    parser.add_argument("--json-logs", action="store_true", help="structured JSON logs (default when not a terminal)")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the RL loop (embedded Redis and the torch engine by default)")
    run.add_argument("--config", help="TOML, JSON or YAML run config")
    run.add_argument("--redis", help="Redis URL (redis://, rediss://, unix://); default: REDIS_URL or an embedded server")
    run.add_argument("--engine", choices=["torch", "vllm"])
    run.add_argument("--ranks", type=int)
    run.add_argument("--mode", choices=["colocated", "disaggregated"])
    run.add_argument("--steps", type=int)
    run.add_argument("--seed", type=int)
    run.add_argument("--run-id")
    run.add_argument("--runs-dir", default="runs")
    run.add_argument("--inject", action="append", default=[], metavar="SPEC", help="fault injection, see DESIGN.md")
    run.add_argument("--vllm-url", action="append", help="an already running vLLM server (one per rank)")
    run.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    run.set_defaults(func=cmd_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.json_logs or not sys.stderr.isatty() and os.environ.get("ROLLEDGER_PRETTY_LOGS") is None)
    code: int = args.func(args)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
