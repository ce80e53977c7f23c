"""The launcher of a local SGLang server (tests, benchmarks and `rolledger run --engine sglang` without URLs).

`start_sglang_server(model_dir, port, ...)` launches `python -m sglang.launch_server` bound to 127.0.0.1 with raw
logprobs (SGLANG_RETURN_ORIGINAL_LOGPROB=1), waits for `/health` with a deadline, logs to a file, and returns a
ServerProcess whose `close()` terminates the process group.

On a host without a GPU (`device="cpu"`) the server runs SGLang's CPU path (SGLANG_USE_CPU_ENGINE=1, torch-native
attention, no CUDA graphs, a small KV pool), with rolledger's STAND-IN for the CUDA-only `sgl_kernel` package first
on its PYTHONPATH (workers/engines/sglang_cpu_standin: every kernel raises NotImplementedError when called; none is
on the paths used). Where the real package loads (a GPU host) the stand-in is not used.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from rolledger.workers.engines.server_process import ServerProcess, launch_server

STANDIN_DIR = Path(__file__).resolve().parent / "sglang_cpu_standin"
CPU_ARGS = (
    "--disable-cuda-graph",
    "--skip-server-warmup",
    "--attention-backend",
    "torch_native",
    "--max-total-tokens",
    "4096",
    "--mem-fraction-static",
    "0.05",
)


def real_kernels_load(python: str) -> bool:
    """Does the real sgl_kernel import in `python`'s environment (it needs libcuda)?"""
    probe = subprocess.run([python, "-c", "import sgl_kernel"], capture_output=True, timeout=300, check=False, cwd="/")
    return probe.returncode == 0


def start_sglang_server(
    model_dir: str | Path,
    port: int,
    *,
    device: str = "cpu",
    env: Mapping[str, str] | None = None,
    log_path: str | Path | None = None,
    dtype: str = "auto",
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
    startup_deadline_s: float = 300.0,
) -> ServerProcess:
    """Start an SGLang server on 127.0.0.1:`port` and wait for GET /health == 200 (or raise EngineError)."""
    model_dir = Path(model_dir).absolute()
    log = Path(log_path) if log_path is not None else model_dir.parent / f"sglang-{port}.log"
    child_env = dict(os.environ)
    child_env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"  # raw logprobs, what the trainer recomputes
    cmd = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--device",
        device,
    ]
    if device == "cpu":
        child_env["SGLANG_USE_CPU_ENGINE"] = "1"
        if not real_kernels_load(python):
            child_env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(STANDIN_DIR), child_env.get("PYTHONPATH", "")) if p
            )
        cmd += CPU_ARGS
    cmd += list(extra_args)
    child_env.update(env or {})
    return launch_server(
        "SGLang",
        cmd,
        port=port,
        model_dir=model_dir,
        log_path=log,
        env=child_env,
        startup_deadline_s=startup_deadline_s,
    )
