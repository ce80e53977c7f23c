"""The launcher of a local vLLM OpenAI server (tests, benchmarks and `rolledger run --engine vllm` without URLs).

`start_vllm_server(model_dir, port, ...)` launches `python -m vllm.entrypoints.openai.api_server` bound to
127.0.0.1 with the RL/dev routes and rolledger's worker extension, waits for `/health` with a deadline, logs to a
file, and returns a `VllmServer` whose `close()` terminates the process group. workers.engines.factory starts one
per rank with it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from rolledger.workers.engines.server_process import ServerProcess, launch_server
from rolledger.workers.engines.vllm_http import DEFAULT_EXTENSION

VllmServer = ServerProcess  # a vLLM server this code started (workers.engines.server_process)


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
    return launch_server(
        "vLLM", cmd, port=port, model_dir=model_dir, log_path=log, env=child_env, startup_deadline_s=startup_deadline_s
    )
