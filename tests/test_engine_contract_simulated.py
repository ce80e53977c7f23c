"""The engine contract (tests/engine_contract.py) run against the SIMULATED engine: generation is declared time
(workers/engines/simulated_engine.py), everything else is a real TorchEngine's. The simulated tokens depend on the
weights digest a sample started on, so "commit changes what is served" holds too. One test does not apply: its
logprobs are declared, not computed from the weights (`computes_logprobs=False` skips the check against torch)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
import torch
from engine_contract import ContractSubject, EngineContract

from rolledger.schemas.config import ModelConfig, SimulatedConfig
from rolledger.workers.engines.simulated_engine import SimulatedEngine
from rolledger.workers.policy.policy_model import build_model, build_tokenizer, policy_state
from rolledger.workers.weights.staging_store import DirectoryStagingStore, StagedUpdate

CONFIG = ModelConfig(dtype="bfloat16")
FAST = SimulatedConfig(time_scale=0.01)  # a 0.45 ms decode step: the contract's 8-token groups take a few ms


@pytest.fixture(scope="module")
def subject(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ContractSubject]:
    tok = build_tokenizer()
    model = build_model(CONFIG, len(tok), seed=0)
    base = {k: v.clone() for k, v in policy_state(model).items()}
    engine = SimulatedEngine(model, tok, FAST, rank=0)
    store = DirectoryStagingStore(tmp_path_factory.mktemp("contract-simulated") / "staging")

    def other(seed: int) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in policy_state(build_model(CONFIG, len(tok), seed=100 + seed)).items()}

    def stage(version: int, tensors: Mapping[str, torch.Tensor]) -> StagedUpdate:
        return store.stage(version, min(engine.policy_version, version - 1), tensors)

    yield ContractSubject(
        engine, lambda: {k: v.clone() for k, v in base.items()}, other, stage, computes_logprobs=False
    )
    engine.close()


class TestSimulatedEngine(EngineContract):
    """Every contract test, on the simulated engine."""
