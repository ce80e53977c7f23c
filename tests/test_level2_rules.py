"""Seed 004's level-2 rules on the vLLM and SGLang engines, driven against the FAKE sleep servers
(tests/fake_sleep_server.py) configured as a server with a speculative draft or an FP8 KV cache: such a server
sleeps at level 1 only (`capabilities.sleep_levels == (1,)`), `sleep(2)` is refused with one line saying why, and a
colocated run at sleep_level 2 on it is refused at engine start (workers.engines.factory.check_level_2)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_sleep_server import FakeSglangSleepServer, FakeVllmSleepServer

from rolledger.schemas.config import ModelConfig, RunConfig
from rolledger.workers.engines.factory import check_level_2
from rolledger.workers.engines.protocol import EngineError
from rolledger.workers.engines.sglang_engine import SglangEngine
from rolledger.workers.engines.sleep_state import level_2_refusal
from rolledger.workers.engines.vllm_engine import VllmEngine
from rolledger.workers.policy.policy_model import build_model, build_tokenizer, save_policy

CONFIG = ModelConfig(dtype="bfloat16")
COLOCATED_2 = RunConfig(mode="colocated", sleep_level=2)

VLLM_CASES = {
    "speculative draft": ({"speculative_config": {"method": "eagle", "model": "draft-1"}}, "speculative draft"),
    "fp8 kv cache": ({"cache_config": {"cache_dtype": "fp8_e4m3"}}, "FP8"),
}
SGLANG_CASES = {
    "speculative draft": ({"speculative_algorithm": "EAGLE"}, "speculative draft"),
    "fp8 kv cache": ({"kv_cache_dtype": "fp8_e5m2"}, "FP8"),
}


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    tok = build_tokenizer()
    model = build_model(CONFIG, len(tok), seed=0)
    return model, tok, save_policy(tmp_path_factory.mktemp("level2") / "model", model, tok)


def _assert_refused_at_level_2(engine: Any, match: str) -> None:
    assert engine.capabilities.sleep_levels == (1,)
    with pytest.raises(EngineError, match=f"sleep\\(2\\) refused: .*{match}.*; sleep at level 1") as refused:
        engine.sleep(2)
    assert "\n" not in str(refused.value)
    assert engine.asleep_level == 0  # nothing was sent
    with pytest.raises(EngineError, match=f"sleep_level 2 is refused: .*{match}.*; use sleep_level 1") as at_start:
        check_level_2(engine, f"rank {engine.rank}", COLOCATED_2)
    assert "\n" not in str(at_start.value)
    check_level_2(engine, f"rank {engine.rank}", RunConfig(mode="colocated", sleep_level=1))  # level 1 is fine


@pytest.mark.parametrize("case", sorted(VLLM_CASES))
def test_vllm_refuses_level_2_with_a_draft_or_fp8_kv(policy: tuple[Any, Any, Path], case: str) -> None:
    model, tok, model_dir = policy
    server_config, match = VLLM_CASES[case]
    fake = FakeVllmSleepServer(model, tok, model_dir, server_config=server_config)
    try:
        engine = VllmEngine(fake.url, rank=0, model_name="fake")
        try:
            _assert_refused_at_level_2(engine, match)
            assert fake.calls == []
        finally:
            engine.close()
    finally:
        fake.close()


@pytest.mark.parametrize("case", sorted(SGLANG_CASES))
def test_sglang_refuses_level_2_with_a_draft_or_fp8_kv(policy: tuple[Any, Any, Path], case: str) -> None:
    model, tok, model_dir = policy
    info, match = SGLANG_CASES[case]
    fake = FakeSglangSleepServer(model, tok, model_dir, server_info=info)
    try:
        engine = SglangEngine(fake.url, rank=0)
        try:
            _assert_refused_at_level_2(engine, match)
            assert fake.calls == []
        finally:
            engine.close()
    finally:
        fake.close()


@pytest.fixture
def plain_vllm(policy: tuple[Any, Any, Path]) -> Iterator[VllmEngine]:
    model, tok, model_dir = policy
    fake = FakeVllmSleepServer(model, tok, model_dir)
    engine = VllmEngine(fake.url, rank=0, model_name="fake")
    yield engine
    engine.close()
    fake.close()


def test_a_server_without_either_sleeps_at_both_levels(plain_vllm: VllmEngine) -> None:
    assert plain_vllm.capabilities.sleep_levels == (1, 2)
    check_level_2(plain_vllm, "rank 0", COLOCATED_2)


def test_the_rule_itself() -> None:
    assert level_2_refusal(speculative="", kv_cache_dtype="auto") == ""
    assert level_2_refusal(speculative="", kv_cache_dtype="bfloat16") == ""
    assert "#52479" in level_2_refusal(speculative="eagle", kv_cache_dtype="auto")
    assert "FP8" in level_2_refusal(speculative="", kv_cache_dtype="FP8")
