"""A local inference server process this code started (vLLM or SGLang): launched in its own process group bound to
127.0.0.1, logging to a file, waited for with a deadline until its health route answers 200, and stopped as a group.

`launch_server(...)` is what workers.engines.vllm_server and workers.engines.sglang_server call with their own
command lines; `ServerProcess.close()` sends SIGTERM to the group, then SIGKILL after a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx

from rolledger.workers.engines.protocol import EngineError


@dataclass
class ServerProcess:
    """A server process this code started; `close()` terminates its whole process group."""

    url: str
    port: int
    model_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    start_s: float  # seconds from launch to the health route's first 200

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def close(self, deadline_s: float = 20.0) -> None:
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=deadline_s)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launch_server(
    what: str,
    cmd: Sequence[str],
    *,
    port: int,
    model_dir: Path,
    log_path: Path,
    env: Mapping[str, str],
    startup_deadline_s: float,
    health_route: str = "/health",
) -> ServerProcess:
    """Run `cmd` (a server listening on 127.0.0.1:`port`) in its own process group with `env`, output appended to
    `log_path`, and wait until GET `health_route` answers 200. EngineError naming `what`, the port and the log's
    last lines when the process exits first or the deadline passes (the process is stopped then)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "ab") as fh:
        proc = subprocess.Popen(list(cmd), stdout=fh, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)
    server = ServerProcess(
        url=f"http://127.0.0.1:{port}", port=port, model_dir=model_dir, log_path=log_path, process=proc, start_s=0.0
    )
    deadline = t0 + startup_deadline_s
    with httpx.Client(timeout=2.0) as client:
        while True:
            if proc.poll() is not None:
                raise EngineError(
                    f"{what} server on port {port} exited with code {proc.returncode} during start-up; log {log_path}:"
                    f"\n{server.log_tail()}"
                )
            try:
                if client.get(f"{server.url}{health_route}").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                server.close()
                raise EngineError(
                    f"{what} server on port {port} not healthy within {startup_deadline_s}s; log {log_path}:\n"
                    f"{server.log_tail()}"
                )
            time.sleep(0.5)  # readiness poll interval, bounded by the deadline above
    server.start_s = time.monotonic() - t0
    return server
