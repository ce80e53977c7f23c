"""The engine contract (tests/engine_contract.py) run against the real `SglangEngine` client driving the FAKE SGLang
sleep server (tests/fake_sleep_server.py): SGLang releases memory only on a GPU with --enable-memory-saver (on CPU
its release crashes the scheduler), so the colocated cycle's routes (/release_memory_occupation and
/resume_memory_occupation by tag, the weight update between them) are answered by the fake with the rules SGLang
states, and what SGLang would crash or hang on is recorded as a violation. The whole contract runs: the fake's
generations are a real torch model's, its checksums those of the live model."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
import torch
from engine_contract import GREEDY, ContractSubject, EngineContract
from fake_sleep_server import FakeSglangSleepServer

from rolledger.schemas.config import ModelConfig
from rolledger.workers.engines.protocol import IllegalEngineOrder
from rolledger.workers.engines.sglang_engine import SglangEngine
from rolledger.workers.policy.policy_model import build_model, build_tokenizer, policy_state, save_policy
from rolledger.workers.weights.staging_store import DirectoryStagingStore, StagedUpdate

CONFIG = ModelConfig(dtype="bfloat16")


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeSglangSleepServer]:
    tok = build_tokenizer()
    model = build_model(CONFIG, len(tok), seed=0)
    model_dir = save_policy(tmp_path_factory.mktemp("fake-sglang") / "model", model, tok)
    server = FakeSglangSleepServer(model, tok, model_dir)
    yield server
    server.close()


@pytest.fixture(scope="module")
def subject(fake: FakeSglangSleepServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ContractSubject]:
    tok = build_tokenizer()
    base = {k: v.clone() for k, v in policy_state(build_model(CONFIG, len(tok), seed=0)).items()}
    engine = SglangEngine(fake.url, rank=0, timeout_s=30.0, pause_timeout_s=30.0)
    store = DirectoryStagingStore(tmp_path_factory.mktemp("contract-fake-sglang") / "staging")

    def other(seed: int) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in policy_state(build_model(CONFIG, len(tok), seed=100 + seed)).items()}

    def stage(version: int, tensors: Mapping[str, torch.Tensor]) -> StagedUpdate:
        return store.stage(version, min(engine.policy_version, version - 1), tensors)

    yield ContractSubject(engine, lambda: {k: v.clone() for k, v in base.items()}, other, stage)
    engine.close()
    assert fake.violations == []  # nothing SGLang would crash or hang on was ever sent


class TestSglangEngineOnTheFakeSleepServer(EngineContract):
    """Every contract test, on the SGLang client against the fake memory-occupation routes."""


def test_a_partial_wake_resumes_only_the_tags_released(subject: ContractSubject, fake: FakeSglangSleepServer) -> None:
    """Resuming a tag that is not released is an error in SGLang: after wake(weights), a wake of both tags must
    resume kv_cache alone."""
    e = subject.engine
    e.pause("wait")
    try:
        fake.calls.clear()
        e.sleep(1)
        e.wake(["weights"])
        with pytest.raises(IllegalEngineOrder, match="kv_cache"):
            e.generate(subject.prompt, 1, GREEDY)
        e.wake(["weights", "kv_cache"])
        assert fake.calls == [
            "/release_memory_occupation?tags=['weights', 'kv_cache']",
            "/resume_memory_occupation?tags=['weights']",
            "/resume_memory_occupation?tags=['kv_cache']",
        ]
        assert not fake.asleep and e.asleep_level == 0
    finally:
        e.resume()
    assert len(e.generate(subject.prompt, 1, GREEDY).samples) == 1
    assert fake.violations == []
