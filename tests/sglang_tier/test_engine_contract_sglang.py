"""The SGLang engine on a real SGLang CPU server (with the stand-in for its CUDA-only kernel package, see conftest):
the engine contract (tests/engine_contract.py), then what the SGLang engine adds to it: a commit whose load fails is
undone by the rank itself (SGLang 0.5.23's own rollback re-reads the new path), rollback goes back exactly one
version, and the weights are always verified from SGLang's own checksums of its live parameters.

The server is started once for this module and stopped at its end, before the loop test starts its own two."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engine_contract import GREEDY, ContractSubject, EngineContract, generate_in_thread

from rolledger.schemas.config import SamplingParams
from rolledger.workers.engines.protocol import EngineError, GroupOutput, IllegalEngineOrder, WeightValidationError
from rolledger.workers.engines.sglang_weights import expected_checksums

from .conftest import SglangRank

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def subject(sglang_rank: SglangRank) -> Iterator[ContractSubject]:
    r = sglang_rank
    yield ContractSubject(
        r.engine,
        r.base_state,
        lambda seed: r.other_state(500 + seed),
        r.stage,
        versions=r.versions,
    )


class TestSglangEngine(EngineContract):
    """Every contract test, on a real SGLang server."""


PROMPT = (1, 4, 5, 14, 6, 15)


def served(r: SglangRank) -> tuple[object, ...]:
    e = r.engine
    s = e.generate(PROMPT, 1, GREEDY).samples[0]
    return (s.token_ids, s.logprobs, e.weights_digest(), e.policy_version, e.http.get("/model_info")["weight_version"])


def commit(r: SglangRank, version: int, seed: int) -> str:
    e = r.engine
    staged = r.stage(version, r.other_state(seed))
    e.prepare(version, staged.uri, staged.manifest)
    e.pause("wait")
    try:
        return str(e.commit_weights(version).weights_digest)
    finally:
        e.resume()


def test_a_commit_whose_load_fails_leaves_the_old_version_serving_and_verified(sglang_rank: SglangRank) -> None:
    r = sglang_rank
    e = r.engine
    before = served(r)
    version = next(r.versions)
    staged = r.stage(version, r.other_state(700 + version))
    e.prepare(version, staged.uri, staged.manifest)
    (e.staging_dir / f"v{version}" / "model.safetensors").unlink()  # gone before commit
    e.pause("wait")
    try:
        with pytest.raises(EngineError, match="update_weights_from_disk"):
            e.commit_weights(version)
    finally:
        e.resume()
    assert served(r) == before  # weights (SGLang's own checksums), label, greedy tokens and logprobs
    later = next(r.versions)
    assert commit(r, later, 800 + later) == e.weights_digest()  # and it takes the next one


def test_rollback_goes_back_exactly_one_version(sglang_rank: SglangRank) -> None:
    r = sglang_rank
    e = r.engine
    before = served(r)
    version = next(r.versions)
    commit(r, version, 900 + version)
    assert served(r) != before
    e.pause("wait")
    try:
        report = e.rollback_weights()
    finally:
        e.resume()
    assert report.policy_version == before[3]
    assert served(r) == before
    with pytest.raises(IllegalEngineOrder, match="no earlier version"):
        e.rollback_weights()


def test_the_live_checksums_are_sglangs_own_and_name_a_differing_tensor(sglang_rank: SglangRank) -> None:
    r = sglang_rank
    e = r.engine
    live = e.live_checksums()
    assert "model.layers.0.self_attn.qkv_proj.weight" in live  # SGLang's fused names, read from the server
    other = r.other_state(1234)
    with pytest.raises(WeightValidationError) as info:
        e._verify_live(e._loaded(99, r.model_dir, other))  # weights it does not serve
    assert info.value.tensor in other
    assert {k: v[0] for k, v in expected_checksums(e._st.live.tensors).items()} == live


def test_the_engine_reports_the_servers_kv_cache_in_tokens(sglang_rank: SglangRank) -> None:
    """What a rank keeps its groups' worst case within (`kv_cache_cap`): SGLang's `max_total_num_tokens`."""
    tokens = sglang_rank.engine.kv_cache_tokens()
    assert tokens is not None and tokens == int(sglang_rank.engine.http.get("/server_info")["max_total_num_tokens"])
    assert tokens > 0


def test_a_request_reaching_the_server_after_an_abort_pause_is_cut_before_the_pause_returns(
    sglang_rank: SglangRank,
) -> None:
    """A request that passed generate's check just before a pause can reach the server after it (a drain with
    abort races the rank's rollout slots). SGLang holds such a request at its door while paused, out of an abort's
    reach: before the engine let held requests in and cut them, pause('abort') returned with the request still held,
    and the drain waited for it until its deadline. Here the server is paused first, behind the engine's back, so the
    request is sure to arrive after the pause."""
    e = sglang_rank.engine
    assert e.http.post("/pause_generation", json={"mode": "abort"}).get("status") == "ok"
    sampling = SamplingParams(temperature=1.0, max_tokens=48, seed=11, logprob_mode="raw")  # the server holds 64
    request, got = generate_in_thread(lambda: e.generate(PROMPT, 2, sampling))
    try:
        with e._cond:
            assert e._cond.wait_for(lambda: e._st.inflight == 1, timeout=30), "the request never left the engine"
        e.pause("abort")
        with e._cond:
            assert e._st.inflight == 0, "pause('abort') returned with a request of this engine still held"
        request.join(timeout=30)  # it has answered already: the deadline only bounds a broken run
        assert not request.is_alive()
        (out,) = got
        assert isinstance(out, GroupOutput), out
        assert len(out.samples) == 2
        assert out.policy_version == e.policy_version  # generated (if at all) on the version still serving
    finally:
        e.resume()
        request.join(timeout=120)
    assert served(sglang_rank)[3] == e.policy_version  # and the server serves again after resume
