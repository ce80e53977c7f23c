"""The inputs of `rolledger run` and of every command that takes RUN, checked before anything heavy is imported
(no torch, no Redis): where runs live (`--runs-dir`, else `$ROLLEDGER_RUNS`, else `./runs`), a run id, a run id
that already has a run, a metrics port, the task (its prompts load, its reward functions import: `check_task`).
A refused input is a `RunRefused`: one line, nothing started."""

from __future__ import annotations

import errno
import os
import re
import socket
from pathlib import Path

from rolledger.schemas.config import RunConfig

RUNS_ENV = "ROLLEDGER_RUNS"
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
RUNS_DIR_HELP = f"--runs-dir, else ${RUNS_ENV}, else ./runs"  # the order, as the CLI's messages and --help name it


class RunRefused(ValueError):
    """An input the run cannot start with (a bad or reused run id, a busy port): one line, nothing started."""


def default_runs_dir() -> Path:
    """Where runs live when no --runs-dir is given: `$ROLLEDGER_RUNS` if set, else `runs` in the working directory."""
    return Path(os.environ.get(RUNS_ENV) or "runs")


def check_run_id(run_id: str) -> None:
    """Refuse a run id that is empty, has path separators, `..`, braces, or characters outside RUN_ID_PATTERN."""
    if not run_id:
        raise RunRefused("run id is empty")
    if "/" in run_id or "\\" in run_id or ".." in run_id or "{" in run_id or "}" in run_id:
        raise RunRefused(f"run id {run_id!r} may not contain '/', '\\', '..' or braces")
    if RUN_ID_PATTERN.fullmatch(run_id) is None:
        raise RunRefused(f"run id {run_id!r} must match {RUN_ID_PATTERN.pattern}")


def has_run(run_dir: Path) -> bool:
    """Whether a directory already holds a run (its Redis URL, an AOF, a summary); a directory seeded with only a
    policy (`model/`, as the vLLM tier prepares it) is not one."""
    return run_dir.is_dir() and any(
        (run_dir / name).exists() for name in ("redis_url", "summary.json", "appendonly.aof", "appendonlydir")
    )


REDIS_FSYNC = ("no", "always")  # the embedded server's appendfsync choices (events/embedded.py FSYNC_POLICIES)


def check_redis_fsync(fsync: str, redis_url: str | None) -> None:
    """`--redis-fsync` sets the embedded server's appendfsync: refused for a server the run does not start."""
    if fsync not in REDIS_FSYNC:
        raise RunRefused(f"--redis-fsync {fsync!r}: must be one of {', '.join(REDIS_FSYNC)}")
    if fsync != "no" and redis_url:
        raise RunRefused(
            f"--redis-fsync {fsync} applies to the embedded server only; with --redis/REDIS_URL set appendfsync on "
            "that server (CONFIG SET appendfsync always, or redis.conf)"
        )


def check_reuse(run_id: str, runs_dir: Path, resume: bool) -> Path:
    """The run's directory; a RunRefused when it already holds a run and `resume` is not set."""
    run_dir = (runs_dir / run_id).absolute()
    if has_run(run_dir) and not resume:
        raise RunRefused(f"run {run_id!r} already exists ({run_dir}); pass --resume to continue it")
    return run_dir


def check_port_free(port: int, addr: str = "127.0.0.1") -> None:
    """Refuse a metrics port something already listens on (or one out of range), before any worker starts."""
    if not 0 < port < 65536:
        raise RunRefused(f"--metrics-port {port} is not a port (1-65535)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as exc:
            why = "already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            raise RunRefused(f"--metrics-port {port} on {addr}: {why}") from None


def check_task(cfg: RunConfig) -> None:
    """Refuse a task whose prompts cannot be loaded (a missing or malformed file, no `datasets` package) or whose
    reward functions or environment cannot be imported (naming `task.rewards[i].fn`, `task.env`), before anything
    starts. Imports the reward functions' and the environment's modules, and `datasets` for a dataset task; nothing of
    the project's heavy parts."""
    from rolledger.workers.policy.envs import import_env
    from rolledger.workers.policy.rewards import resolve
    from rolledger.workers.policy.task_plugins import load_prompts

    try:
        resolve(cfg.task)
        if cfg.task.env is not None:
            import_env("task.env", cfg.task.env)
        load_prompts(cfg.task, cfg.seed)
    except ValueError as exc:  # RewardRefused, EnvRefused, TaskRefused
        raise RunRefused(" ".join(str(exc).split())) from None
