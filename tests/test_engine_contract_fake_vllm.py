"""The engine contract (tests/engine_contract.py) run against the real `VllmEngine` client driving the FAKE vLLM
sleep server (tests/fake_sleep_server.py): vLLM refuses sleep mode on CPU, so the colocated cycle's routes
(/sleep, /wake_up?tags=, the weight RPCs between them) are answered by the fake with the rules vLLM states, and every
route the client sends that vLLM would crash or hang on is recorded as a violation. The whole contract runs: the
fake's completions are a real torch model's, its weight RPCs the real rolledger worker extension's."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
import torch
from engine_contract import GREEDY, ContractSubject, EngineContract
from fake_sleep_server import FakeVllmSleepServer

from rolledger.schemas.config import ModelConfig
from rolledger.workers.engines.protocol import IllegalEngineOrder
from rolledger.workers.engines.vllm_engine import VllmEngine
from rolledger.workers.policy.policy_model import build_model, build_tokenizer, policy_state, save_policy
from rolledger.workers.weights.staging_store import DirectoryStagingStore, StagedUpdate

CONFIG = ModelConfig(dtype="bfloat16")


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeVllmSleepServer]:
    tok = build_tokenizer()
    model = build_model(CONFIG, len(tok), seed=0)
    model_dir = save_policy(tmp_path_factory.mktemp("fake-vllm") / "model", model, tok)
    server = FakeVllmSleepServer(model, tok, model_dir)
    yield server
    server.close()


@pytest.fixture(scope="module")
def subject(fake: FakeVllmSleepServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ContractSubject]:
    tok = build_tokenizer()
    base = {k: v.clone() for k, v in policy_state(build_model(CONFIG, len(tok), seed=0)).items()}
    engine = VllmEngine(fake.url, rank=0, model_name="fake", timeout_s=30.0)
    store = DirectoryStagingStore(tmp_path_factory.mktemp("contract-fake-vllm") / "staging")

    def other(seed: int) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in policy_state(build_model(CONFIG, len(tok), seed=100 + seed)).items()}

    def stage(version: int, tensors: Mapping[str, torch.Tensor]) -> StagedUpdate:
        return store.stage(version, min(engine.policy_version, version - 1), tensors)

    yield ContractSubject(engine, lambda: {k: v.clone() for k, v in base.items()}, other, stage)
    engine.close()
    assert fake.violations == []  # nothing vLLM would crash or hang on was ever sent


class TestVllmEngineOnTheFakeSleepServer(EngineContract):
    """Every contract test, on the vLLM client against the fake sleep routes."""


def test_a_partial_wake_sends_only_the_tags_that_sleep(subject: ContractSubject, fake: FakeVllmSleepServer) -> None:
    """vLLM wakes nothing when asked for a tag that does not sleep: after wake(weights), a wake of both tags must
    send kv_cache alone, or the KV cache would stay asleep while the engine counts itself awake."""
    e = subject.engine
    e.pause("wait")
    try:
        fake.calls.clear()
        e.sleep(1)
        e.wake(["weights"])
        with pytest.raises(IllegalEngineOrder, match="kv_cache"):
            e.generate(subject.prompt, 1, GREEDY)
        e.wake(["weights", "kv_cache"])
        assert fake.calls == ["/sleep?level=1&mode=wait", "/wake_up?tags=weights", "/wake_up?tags=kv_cache"]
        assert not fake.asleep and e.asleep_level == 0
    finally:
        e.resume()
    assert len(e.generate(subject.prompt, 1, GREEDY).samples) == 1
    assert fake.violations == []
