"""The engine contract (tests/engine_contract.py) run against the torch engine; the vLLM and SGLang tiers run the
same tests against their servers."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path

import pytest
import torch
from engine_contract import ContractSubject, EngineContract

from rolledger.schemas.config import ModelConfig
from rolledger.workers.engines.engine_process import EngineProcess
from rolledger.workers.engines.protocol import Engine
from rolledger.workers.engines.torch_engine import TorchEngine
from rolledger.workers.policy.policy_model import build_model, build_tokenizer, policy_state
from rolledger.workers.weights.staging_store import DirectoryStagingStore, StagedUpdate

CONFIG = ModelConfig(dtype="bfloat16")


@pytest.fixture(
    scope="module",
    params=["one-group", "batch-groups", "process"],
)
def subject(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[ContractSubject]:
    tok = build_tokenizer()
    model = build_model(CONFIG, len(tok), seed=0)
    base = {k: v.clone() for k, v in policy_state(model).items()}
    engine: Engine
    if request.param == "process":  # the batching torch engine in a process of its own (workers/engines/engine_process)
        engine = EngineProcess(partial(TorchEngine, model, tok, rank=0, batch_groups=True), torch_threads=1)
    else:
        engine = TorchEngine(model, tok, rank=0, batch_groups=request.param == "batch-groups")
    store = DirectoryStagingStore(tmp_path_factory.mktemp("contract") / "staging")

    def other(seed: int) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in policy_state(build_model(CONFIG, len(tok), seed=100 + seed)).items()}

    def stage(version: int, tensors: Mapping[str, torch.Tensor]) -> StagedUpdate:
        return store.stage(version, min(engine.policy_version, version - 1), tensors)

    yield ContractSubject(engine, lambda: {k: v.clone() for k, v in base.items()}, other, stage)
    engine.close()


class TestTorchEngine(EngineContract):
    """Every contract test, on the torch engine: in-process with one group per decode or groups batched together, and
    batching in a process of its own."""


def test_the_contract_module_is_collected_once_per_engine() -> None:
    tests = [n for n in dir(EngineContract) if n.startswith("test_")]
    assert len(tests) >= 12
    for tier in ("vllm_tier/test_engine_contract_vllm.py", "sglang_tier/test_engine_contract_sglang.py"):
        assert "(EngineContract)" in (Path(__file__).parent / tier).read_text(), tier
