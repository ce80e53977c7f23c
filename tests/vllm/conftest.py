"""The vLLM tier's fixtures: a tiny policy checkpoint and two real vLLM CPU servers (two ranks), once per session.

Every test here needs `import vllm` to work in this interpreter (the `.venv-vllm` environment, see docs/vllm.md); without it each test
is skipped with the reason. Servers take 30-60 s to start, so they are started once, in parallel, and shared: tests
must leave them serving (resumed, no staged update) and use `cluster.next_version()` for fresh policy versions.

`vllm_cluster` is also the helper for loop tests: it gives the server URLs, the model directory and name, engines
for both ranks, and a staging store whose URIs the servers can read.
"""

from __future__ import annotations

import functools
import itertools
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from schemas.config import ModelConfig, SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def vllm_import_error() -> str:
    """'' when `import vllm` works in this interpreter, else why not.

    Checked in a subprocess run from the repository root: inside pytest, `tests/` is on sys.path, so `import vllm`
    here would find this test package (tests/vllm) instead of the real one.
    """
    proc = subprocess.run(
        [sys.executable, "-c", "import vllm"], check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    if proc.returncode == 0:
        return ""
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {proc.returncode}"


def skip_reason() -> str:
    return (
        f"vLLM is not importable by {sys.executable} ({vllm_import_error()}); run the tier with the .venv-vllm "
        "python (docs/vllm.md)"
    )


@pytest.fixture(autouse=True)
def _require_vllm() -> None:
    if vllm_import_error():
        pytest.skip(skip_reason())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprob_mode="raw")
PROMPT: tuple[int, ...] = (1, 4, 5, 14, 6, 15)  # <bos> "12+3=" in the character tokenizer (any ids < vocab work)


@dataclass
class VllmCluster:
    """Two ranks of real vLLM servers, their engines, the checkpoint they serve and a staging store."""

    model_dir: Path
    model_name: str
    servers: list  # list[VllmServer]
    engines: list  # list[VllmEngine]
    staging_root: Path
    _versions: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def next_version(self) -> int:
        """A policy version newer than any used so far in this session (servers are shared across tests)."""
        return next(self._versions)

    def base_state(self) -> dict[str, torch.Tensor]:
        """The HF-named tensors of the checkpoint the servers started from."""
        from safetensors.torch import load_file

        return load_file(str(self.model_dir / "model.safetensors"))

    def other_state(self, seed: int) -> dict[str, torch.Tensor]:
        """Weights of a differently initialised policy of the same shape (a 'trained' update)."""
        from workers.policy_model import build_model, policy_state

        vocab = int(self.base_state()["model.embed_tokens.weight"].shape[0])
        model = build_model(ModelConfig(dtype="bfloat16"), vocab, seed=seed)
        return {k: v.clone() for k, v in policy_state(model).items()}

    def stage(self, version: int, tensors: Mapping[str, torch.Tensor]):  # -> workers.staging.StagedUpdate
        from workers.staging import DirectoryStagingStore

        base = max(e.policy_version for e in self.engines)
        return DirectoryStagingStore(self.staging_root).stage(version, min(base, version - 1), tensors)

    def greedy(self, rank: int) -> tuple[list[int], list[float]]:
        out = self.engines[rank].generate(PROMPT, 1, GREEDY)
        s = out.samples[0]
        return s.token_ids, s.logprobs


def _build_checkpoint(directory: Path) -> Path:
    from workers.policy_model import build_model, build_tokenizer, save_policy

    torch.manual_seed(0)
    tok = build_tokenizer()
    model = build_model(ModelConfig(dtype="bfloat16"), len(tok), seed=0)
    return save_policy(directory, model, tok)


@pytest.fixture(scope="session")
def vllm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCluster]:
    if vllm_import_error():
        pytest.skip(skip_reason())
    from workers.engines.vllm_engine import VllmEngine, VllmServer, start_vllm_server

    root = tmp_path_factory.mktemp("vllm_tier")
    model_dir = _build_checkpoint(root / "model")
    servers: list[VllmServer | None] = [None, None]
    errors: list[BaseException] = []

    def launch(rank: int) -> None:
        try:
            servers[rank] = start_vllm_server(model_dir, free_port(), log_path=root / f"vllm-rank{rank}.log")
        except BaseException as e:  # noqa: BLE001 - re-raised below on the test thread
            errors.append(e)

    threads = [threading.Thread(target=launch, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    started = [s for s in servers if s is not None]
    try:
        if errors:
            raise errors[0]
        engines = [VllmEngine(s.url, rank=r, model_name=str(model_dir), timeout_s=60.0) for r, s in enumerate(started)]
        cluster = VllmCluster(model_dir, str(model_dir), started, engines, root / "staging")
        print(f"\nvLLM servers ready: start {[round(s.start_s, 1) for s in started]} s")
        yield cluster
        for e in engines:
            e.close()
    finally:
        for s in started:
            s.close()


@pytest.fixture(scope="session")
def vllm_run_config(vllm_cluster: VllmCluster):  # -> schemas.config.RunConfig
    """A RunConfig for a loop test against the session's two servers (engine=vllm, ranks=2, their URLs).

    The servers' start-up checkpoint is `build_model(ModelConfig(dtype="bfloat16"), vocab, seed=0)` with the
    character tokenizer; a loop whose trainer starts from other weights should stage and commit them as its first
    update (every update replaces all tensors). Staged updates must be written under `vllm_cluster.staging_root`
    (or any path the servers can read: they run on this host).
    """
    from schemas.config import RunConfig

    return RunConfig(
        engine="vllm",
        ranks=len(vllm_cluster.servers),
        vllm_urls=tuple(vllm_cluster.urls),
        model=ModelConfig(dtype="bfloat16"),
        sampling=SamplingParams(logprob_mode="raw"),
    )
