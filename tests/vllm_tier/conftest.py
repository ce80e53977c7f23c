"""The vLLM tier's fixtures: a tiny policy checkpoint and two real vLLM CPU servers (two ranks), once per session.

Every test here needs `import vllm` to work in this interpreter (the `.venv-vllm` environment, see docs/vllm.md); without it each test
is skipped with the reason. Servers take 30-60 s to start, so they are started once, in parallel, and shared: tests
must leave them serving (resumed, no staged update) and use `cluster.next_version()` for fresh policy versions.

`vllm_cluster` is also the helper for loop tests: it gives the server URLs, the model directory and name, engines
for both ranks, and a staging store whose URIs the servers can read.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from rolledger.schemas.config import ModelConfig, SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def vllm_import_error() -> str:
    """'' when `import vllm` works in this interpreter, else why not.

    Checked in a subprocess run from the repository root: inside pytest, `tests/` is on sys.path, so `import vllm`
    here would find this test package (tests/vllm_tier) instead of the real one.
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
        from rolledger.workers.policy.policy_model import build_model, policy_state

        vocab = int(self.base_state()["model.embed_tokens.weight"].shape[0])
        model = build_model(ModelConfig(dtype="bfloat16"), vocab, seed=seed)
        return {k: v.clone() for k, v in policy_state(model).items()}

    def stage(self, version: int, tensors: Mapping[str, torch.Tensor]):  # -> workers.weights.staging_store.StagedUpdate
        from rolledger.workers.weights.staging_store import DirectoryStagingStore

        base = max(e.policy_version for e in self.engines)
        return DirectoryStagingStore(self.staging_root).stage(version, min(base, version - 1), tensors)

    def greedy(self, rank: int) -> tuple[list[int], list[float]]:
        out = self.engines[rank].generate(PROMPT, 1, GREEDY)
        s = out.samples[0]
        return s.token_ids, s.logprobs


def _build_checkpoint(directory: Path) -> Path:
    from rolledger.workers.policy.policy_model import build_model, build_tokenizer, save_policy

    torch.manual_seed(0)
    tok = build_tokenizer()
    model = build_model(ModelConfig(dtype="bfloat16"), len(tok), seed=0)
    return save_policy(directory, model, tok)


@pytest.fixture(scope="session")
def vllm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCluster]:
    if vllm_import_error():
        pytest.skip(skip_reason())
    from rolledger.workers.engines.vllm_engine import VllmEngine
    from rolledger.workers.engines.vllm_server import VllmServer, start_vllm_server

    root = tmp_path_factory.mktemp("vllm_tier")
    model_dir = _build_checkpoint(root / "model")
    servers: list[VllmServer | None] = [None, None]
    errors: list[BaseException] = []

    def launch(rank: int) -> None:
        try:
            servers[rank] = start_vllm_server(
                model_dir,
                free_port(),
                log_path=root / f"vllm-rank{rank}.log",
                # rolledger's transport as a vLLM weight-transfer engine (workers/weights/vllm_transfer_engine.py)
                extra_args=["--weight-transfer-config", json.dumps({"backend": "rolledger"})],
            )
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


# ------------------------------------------------------------------------------------------ loop-test servers

LOOP_CONFIG: dict[str, object] = {
    "engine": "vllm",
    "steps": 3,
    "group_size": 4,
    "ranks": 2,
    "trainer": {"warm_start_steps": 20, "groups_per_step": 2},
    "task": {"num_prompts": 64},
    "update": {"prepare_deadline_s": 60, "drain_deadline_s": 60, "commit_deadline_s": 60},
    "model": {"architecture": "llama"},  # the engine tests' servers serve a Qwen2 checkpoint: the tier serves both
}


@dataclass
class LoopServers:
    """Two vLLM servers serving a loop run's initial policy (a tiny Llama, float32, warm-started), for `rolledger run`
    tests.

    The session's `vllm_cluster` cannot serve a loop run: it serves a random bf16 checkpoint, and its tests move
    it to later policy versions, while a run starts on version 0 with its own warm-started policy (the trainer
    halts when the engine's logprobs disagree with its weights, and the audit checks version-0 digests). These
    servers are started from `model_dir`, built with `LOOP_CONFIG`; a run uses them by getting a copy of
    `model_dir` as `runs/<run-id>/model` (`seed_run_dir`) and `vllm_urls=urls`. A run that commits moves them past
    version 0: `ensure_fresh()` restarts any such server before the next run, so tests do not depend on order.
    """

    model_dir: Path
    log_dir: Path
    servers: list  # list[VllmServer]
    restarts: int = 0

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(s.url for s in self.servers)

    def config(self, **overrides: object):  # -> schemas.config.RunConfig
        from rolledger.schemas.config import RunConfig

        data = {**LOOP_CONFIG, "vllm_urls": self.urls, **overrides}
        return RunConfig.model_validate(data)

    def seed_run_dir(self, run_dir: Path) -> None:
        """Give a run the policy these servers serve (LocalRun reuses a saved runs/<run-id>/model)."""
        import shutil

        shutil.copytree(self.model_dir, run_dir / "model")

    def versions(self) -> list[str]:
        import httpx

        return [str(httpx.get(f"{u}/weight_info", timeout=30).json().get("weight_version")) for u in self.urls]

    def ensure_fresh(self) -> None:
        from rolledger.workers.engines.factory import start_rank_servers

        stale = [r for r, v in enumerate(self.versions()) if v not in ("default", "0")]
        if not stale:
            return
        for s in self.servers:
            s.close()
        self.servers = start_rank_servers(self.config(vllm_urls=()), self.model_dir, self.log_dir)
        self.restarts += 1


@contextlib.contextmanager
def started_loop_servers(
    tmp_path_factory: pytest.TempPathFactory, name: str, config: dict[str, object]
) -> Iterator[LoopServers]:
    """`config.ranks` servers started by `rolledger run`'s own launcher (workers.engines.factory) from a loop policy
    built with `config` (its sampling's logprob mode is the servers' --logprobs-mode), closed on exit."""
    if vllm_import_error():
        pytest.skip(skip_reason())
    from rolledger.schemas.config import RunConfig
    from rolledger.workers.engines.factory import start_rank_servers
    from rolledger.workers.operator.local_run import prepare_policy

    root = tmp_path_factory.mktemp(name)
    cfg = RunConfig.model_validate(config)
    prepare_policy(cfg, root / "model")
    servers = LoopServers(root / "model", root, start_rank_servers(cfg, root / "model", root))
    print(f"\nvLLM {name} servers ready: start {[round(s.start_s, 1) for s in servers.servers]} s")
    try:
        yield servers
    finally:
        for s in servers.servers:
            s.close()


@pytest.fixture(scope="module")
def vllm_loop_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopServers]:
    """Two servers started by `rolledger run`'s own launcher (workers.engines.factory) from a loop policy."""
    with started_loop_servers(tmp_path_factory, "vllm_loop", LOOP_CONFIG) as servers:
        yield servers


@pytest.fixture
def unwarmed_loop_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopServers]:
    """Two servers like `vllm_loop_servers` on a policy that was never warm-started: its <eos> is about as likely as
    any other token, so samples run tens of tokens (the warm-started policy answers in three), long enough for an
    update's drain to find some still generating. Started for one test and stopped after it."""
    if vllm_import_error():
        pytest.skip(skip_reason())
    from rolledger.schemas.config import RunConfig
    from rolledger.workers.engines.factory import start_rank_servers
    from rolledger.workers.operator.local_run import prepare_policy

    root = tmp_path_factory.mktemp("vllm_unwarmed")
    cfg = RunConfig.model_validate({**LOOP_CONFIG, "trainer": {"warm_start_steps": 0, "groups_per_step": 2}})
    prepare_policy(cfg, root / "model")
    servers = LoopServers(root / "model", root, start_rank_servers(cfg, root / "model", root))
    try:
        yield servers
    finally:
        for s in servers.servers:
            s.close()


@pytest.fixture
def fresh_loop_servers(vllm_loop_servers: LoopServers) -> LoopServers:
    """The loop servers, on policy version 0 with the initial policy (restarted if an earlier run moved them)."""
    vllm_loop_servers.ensure_fresh()
    return vllm_loop_servers
