"""The SGLang tier's fixtures: a real SGLang server on CPU serving a tiny policy checkpoint, once per module (the loop
test starts its own two through `rolledger run`; two idle servers would only slow it down on a small machine).

Every test here needs `import sglang` to work in this interpreter (the `.venv-sglang` environment built by
.ci/sglang-tier.sh, see docs/sglang.md); without it each test is skipped with the reason. On CPU the server runs with
rolledger's STAND-IN for the CUDA-only `sgl_kernel` package (workers/engines/sglang_cpu_standin; every kernel
raises NotImplementedError if called) where the real package cannot load.
"""

from __future__ import annotations

import functools
import itertools
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from rolledger.schemas.config import ModelConfig
from rolledger.workers.engines.server_process import ServerProcess
from rolledger.workers.engines.sglang_engine import SglangEngine
from rolledger.workers.weights.staging_store import DirectoryStagingStore, StagedUpdate

REPO_ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def sglang_import_error() -> str:
    """'' when `import sglang` works in this interpreter, else why not (checked outside the repository, where
    tests/sglang_tier cannot shadow the real package)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import sglang"], check=False, cwd="/", capture_output=True, text=True, timeout=300
    )
    if proc.returncode == 0:
        return ""
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {proc.returncode}"


def skip_reason() -> str:
    return (
        f"SGLang is not importable by {sys.executable} ({sglang_import_error()}); run the tier with the .venv-sglang "
        "python (docs/sglang.md)"
    )


@pytest.fixture(autouse=True)
def _require_sglang() -> None:
    if sglang_import_error():
        pytest.skip(skip_reason())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class SglangRank:
    """One real SGLang server, its engine, the checkpoint it serves and a staging store it can read."""

    model_dir: Path
    server: ServerProcess
    engine: SglangEngine
    staging_root: Path
    versions: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def base_state(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.model_dir / "model.safetensors"))

    def other_state(self, seed: int) -> dict[str, torch.Tensor]:
        from rolledger.workers.policy.policy_model import build_model, policy_state

        vocab = int(self.base_state()["model.embed_tokens.weight"].shape[0])
        model = build_model(ModelConfig(dtype="bfloat16"), vocab, seed=seed)
        return {k: v.clone() for k, v in policy_state(model).items()}

    def stage(self, version: int, tensors: Mapping[str, torch.Tensor]) -> StagedUpdate:
        base = min(self.engine.policy_version, version - 1)
        return DirectoryStagingStore(self.staging_root).stage(version, base, tensors)


@pytest.fixture(scope="module")
def sglang_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangRank]:
    if sglang_import_error():
        pytest.skip(skip_reason())
    from rolledger.workers.engines.sglang_server import start_sglang_server
    from rolledger.workers.policy.policy_model import build_model, build_tokenizer, save_policy

    root = tmp_path_factory.mktemp("sglang_tier")
    tok = build_tokenizer()
    model_dir = save_policy(root / "model", build_model(ModelConfig(dtype="bfloat16"), len(tok), seed=0), tok)
    server = start_sglang_server(model_dir, free_port(), log_path=root / "sglang-rank0.log", dtype="bfloat16")
    try:
        engine = SglangEngine(server.url, rank=0)
        print(f"\nSGLang server ready in {server.start_s:.1f} s")
        yield SglangRank(model_dir, server, engine, root / "staging")
        engine.close()
    finally:
        server.close()
