"""The launcher of a local vLLM OpenAI server (tests, benchmarks and `rolledger run --engine vllm` without URLs).

`start_vllm_server(model_dir, port, ...)` launches `python -m vllm.entrypoints.openai.api_server` bound to
127.0.0.1 with the RL/dev routes and rolledger's worker extension, waits for `/health` with a deadline, logs to a
file, and returns a `VllmServer` whose `close()` terminates the process group. workers.engines.factory starts one
per rank with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx

from rolledger.workers.engine import EngineError
from rolledger.workers.engines.vllm_http import DEFAULT_EXTENSION


@dataclass
class VllmServer:
    """A vLLM server process this code started; `close()` terminates its whole process group."""

    url: str
    port: int
    model_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    start_s: float  # seconds from launch to /health 200

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


def start_vllm_server(
    model_dir: str | Path,
    port: int,
    *,
    extension: str = DEFAULT_EXTENSION,
    env: Mapping[str, str] | None = None,
    log_path: str | Path | None = None,
    max_model_len: int | None = None,
    dtype: str = "bfloat16",
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
    startup_deadline_s: float = 240.0,
) -> VllmServer:
    """Start a vLLM OpenAI server on 127.0.0.1:`port` and wait for GET /health == 200 (or raise EngineError).

    The RL/dev routes are enabled (VLLM_SERVER_DEV_MODE=1) and the KV cache kept at 1 GiB on CPU
    (VLLM_CPU_KVCACHE_SPACE=1); `env` adds or overrides variables. The child runs in its own process group.
    """
    model_dir = Path(model_dir).absolute()
    log = Path(log_path) if log_path is not None else model_dir.parent / f"vllm-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    child_env = dict(os.environ)
    child_env.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    child_env.update(env or {})
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--worker-extension-cls",
        extension,
        *extra_args,
    ]
    if max_model_len is not None:  # default: the model's max_position_embeddings
        cmd += ["--max-model-len", str(max_model_len)]
    t0 = time.monotonic()
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=child_env, start_new_session=True)
    server = VllmServer(
        url=f"http://127.0.0.1:{port}", port=port, model_dir=model_dir, log_path=log, process=proc, start_s=0.0
    )
    deadline = t0 + startup_deadline_s
    with httpx.Client(timeout=2.0) as client:
        while True:
            if proc.poll() is not None:
                raise EngineError(
                    f"vLLM server on port {port} exited with code {proc.returncode} during start-up; log {log}:\n"
                    f"{server.log_tail()}"
                )
            try:
                if client.get(f"{server.url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                server.close()
                raise EngineError(
                    f"vLLM server on port {port} not healthy within {startup_deadline_s}s; log {log}:\n"
                    f"{server.log_tail()}"
                )
            time.sleep(0.5)  # readiness poll interval, bounded by the deadline above
    server.start_s = time.monotonic() - t0
    return server
