"""VllmEngine and the worker extension against two real vLLM CPU servers (two ranks).

The tests play the update coordinator: prepare on every rank, then commit everywhere or discard everywhere. They
check what a rank serves (greedy tokens and logprobs, the weights digest, /weight_info, the live digest), not just
what the engine says.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from engine_contract import SAMPLED, ContractSubject

from rolledger.schemas.config import SamplingParams
from rolledger.workers.engines.protocol import Engine, EngineError, IllegalEngineOrder, WeightValidationError
from rolledger.workers.weights.staging_store import StagedUpdate
from rolledger.workers.weights.tensors import state_digest

from .conftest import GREEDY, PROMPT, VllmCluster

pytestmark = pytest.mark.vllm


def _snapshot(cluster: VllmCluster) -> list[tuple[object, ...]]:
    """What each rank serves: greedy output, weights digest, live digest, version label."""
    return [
        (cluster.greedy(r), e.weights_digest(), e.live_digest(), e.http.get("/weight_info")["weight_version"])
        for r, e in enumerate(cluster.engines)
    ]


def _prepare_all(cluster: VllmCluster, version: int, staged: StagedUpdate) -> list[BaseException | str]:
    out: list[BaseException | str] = []
    for e in cluster.engines:
        try:
            out.append(e.prepare_from_uri(version, staged.uri, staged.manifest))
        except EngineError as err:
            out.append(err)
    return out


def test_engine_protocol_and_capabilities(vllm_cluster: VllmCluster) -> None:
    for e in vllm_cluster.engines:
        assert isinstance(e, Engine)
        caps = e.capabilities
        assert caps.name == "vllm"
        assert caps.sleep_levels == ()  # CPU: vLLM refuses --enable-sleep-mode
        assert caps.logprob_mode == "raw"  # the server's default --logprobs-mode raw_logprobs
        assert caps.prefix_cache is True
        tokens = e.kv_cache_tokens()  # num_gpu_blocks x block_size of the server's cache_config_info metric
        assert tokens is not None and tokens > 0, tokens
        specs = e.live_tensor_specs()
        base = vllm_cluster.base_state()
        assert set(specs) == set(base)
        assert specs["model.embed_tokens.weight"].shape == tuple(base["model.embed_tokens.weight"].shape)


def test_generate_group_with_token_ids_and_logprobs(vllm_cluster: VllmCluster) -> None:
    e = vllm_cluster.engines[0]
    before = e.stats.generated_tokens
    out = e.generate(PROMPT, 4, SamplingParams(temperature=1.0, max_tokens=12, seed=3))
    assert len(out.samples) == 4
    vocab = vllm_cluster.base_state()["model.embed_tokens.weight"].shape[0]
    for s in out.samples:
        assert 1 <= len(s.token_ids) <= 12
        assert len(s.logprobs) == len(s.token_ids)
        assert all(0 <= t < vocab for t in s.token_ids)
        assert all(x <= 0.0 and math.isfinite(x) for x in s.logprobs)
        assert s.finish_reason in ("stop", "length")
    assert out.policy_version == e.policy_version
    assert out.weights_digest == e.weights_digest()
    assert e.stats.generated_tokens - before == sum(len(s.token_ids) for s in out.samples)
    # greedy is deterministic and both ranks serve the same checkpoint
    assert vllm_cluster.greedy(0) == vllm_cluster.greedy(1) == vllm_cluster.greedy(0)


def test_start_digest_is_the_checkpoint_state_digest(vllm_cluster: VllmCluster) -> None:
    # holds at session start and after any completed test (each restores the start-up weights or commits anew)
    digests = {e.weights_digest() for e in vllm_cluster.engines}
    assert len(digests) == 1


def test_commit_on_both_ranks_then_rollback(vllm_cluster: VllmCluster) -> None:
    c = vllm_cluster
    before = _snapshot(c)
    version = c.next_version()
    new = c.other_state(seed=100 + version)
    staged = c.stage(version, new)
    results = _prepare_all(c, version, staged)
    assert results == [state_digest(new)] * 2, results
    assert _snapshot(c) == before  # prepared, not live
    for e in c.engines:
        e.pause("wait")
        report = e.commit_weights(version)
        e.resume()
        assert report.policy_version == version
        assert report.weights_digest == state_digest(new) == staged.manifest.weights_digest
    after = _snapshot(c)
    for r in range(2):
        assert after[r][1] == state_digest(new)
        assert after[r][3] == str(version)  # /weight_info follows the policy version
        assert after[r][0] != before[r][0]  # the served outputs changed
        assert after[r][2] != before[r][2]  # and so did the live weights
    assert after[0][0] == after[1][0]  # both ranks serve the same policy
    out = c.engines[0].generate(PROMPT, 1, GREEDY)
    assert out.policy_version == version and out.weights_digest == state_digest(new)
    # rollback restores exactly what served before
    for e in c.engines:
        e.rollback_weights()
    assert _snapshot(c) == before


def test_prepare_failure_on_one_rank_commits_nowhere(vllm_cluster: VllmCluster) -> None:
    c = vllm_cluster
    before = _snapshot(c)
    version = c.next_version()
    staged = c.stage(version, c.other_state(seed=200 + version))
    c.engines[1].inject("fail-prepare")
    results = _prepare_all(c, version, staged)
    assert isinstance(results[0], str)
    assert isinstance(results[1], EngineError) and "injected prepare failure" in str(results[1])
    # coordinator: not every rank prepared -> abort -> discard everywhere
    for e in c.engines:
        e.discard_weights()
    for e in c.engines:
        with pytest.raises(IllegalEngineOrder, match="staged is None"):
            e.commit_weights(version)
    assert _snapshot(c) == before


def test_corrupt_transfer_is_refused_naming_the_tensor(vllm_cluster: VllmCluster) -> None:
    c = vllm_cluster
    before = _snapshot(c)
    version = c.next_version()
    staged = c.stage(version, c.other_state(seed=300 + version))
    c.engines[0].inject("corrupt-prepare")
    with pytest.raises(WeightValidationError, match="checksum") as info:
        c.engines[0].prepare_from_uri(version, staged.uri, staged.manifest)
    assert info.value.tensor == staged.manifest.tensors[0].name
    assert _snapshot(c) == before


def test_shape_mismatch_is_refused_naming_the_tensor(vllm_cluster: VllmCluster) -> None:
    c = vllm_cluster
    version = c.next_version()
    bad = c.base_state()
    bad["model.layers.0.mlp.up_proj.weight"] = bad["model.layers.0.mlp.up_proj.weight"][:-1].clone()
    staged = c.stage(version, bad)
    with pytest.raises(WeightValidationError) as info:
        c.engines[1].prepare_from_uri(version, staged.uri, staged.manifest)
    assert info.value.tensor == "model.layers.0.mlp.up_proj.weight"
    assert "shape" in info.value.reason


@pytest.mark.parametrize("fault", ["fail-commit", "stale-commit"])
def test_failed_commit_rolls_back_inside_the_rank(vllm_cluster: VllmCluster, fault: str) -> None:
    c = vllm_cluster
    e = c.engines[0]
    before = _snapshot(c)
    version = c.next_version()
    staged = c.stage(version, c.other_state(seed=400 + version))
    e.prepare_from_uri(version, staged.uri, staged.manifest)
    e.inject(fault)
    with pytest.raises(EngineError, match="injected commit failure" if fault == "fail-commit" else "did not change"):
        e.commit_weights(version)
    assert _snapshot(c) == before


def test_reset_prefix_cache_bumps_generation(vllm_cluster: VllmCluster) -> None:
    e = vllm_cluster.engines[0]
    g0 = e.generate(PROMPT, 1, GREEDY).cache_generation
    assert e.reset_prefix_cache() == g0 + 1
    assert e.generate(PROMPT, 1, GREEDY).cache_generation == g0 + 1


def test_pause_resume(vllm_cluster: VllmCluster) -> None:
    e = vllm_cluster.engines[1]
    assert e.is_paused is False
    e.pause("wait")
    try:
        assert e.is_paused is True
        with pytest.raises(IllegalEngineOrder, match="paused"):
            e.generate(PROMPT, 1, GREEDY)
    finally:
        e.resume()
    assert e.is_paused is False
    assert len(e.generate(PROMPT, 1, GREEDY).samples) == 1


def test_sleep_reported_unavailable(vllm_cluster: VllmCluster) -> None:
    e = vllm_cluster.engines[0]
    with pytest.raises(EngineError, match="sleep is unavailable"):
        e.sleep(1)
    with pytest.raises(EngineError, match="wake is unavailable"):
        e.wake(["weights"])
    assert e.asleep_level == 0


def test_health_probe_agrees_across_ranks(vllm_cluster: VllmCluster) -> None:
    reports = [e.health() for e in vllm_cluster.engines]
    assert all(r.ok for r in reports), reports
    assert reports[0].probe_digest == reports[1].probe_digest


def test_stage_weights_through_temp_store(vllm_cluster: VllmCluster) -> None:
    c = vllm_cluster
    e = c.engines[1]
    version = c.next_version()
    base = c.base_state()
    digest = e.stage_weights(version, base)  # the start-up weights again: validated like any update
    assert digest == state_digest(base)
    e.discard_weights()


def test_error_shapes_are_parsed(vllm_cluster: VllmCluster) -> None:
    e = vllm_cluster.engines[0]
    with pytest.raises(EngineError, match="HTTP 4\\d\\d: .*"):
        e.http.post("/pause", params={"mode": "bogus"})  # RL route shape or validation shape
    with pytest.raises(EngineError, match="HTTP 404"):
        e.http.post("/v1/completions", json={"model": "no-such-model", "prompt": [1], "max_tokens": 1})


def test_an_update_through_the_dist_transport_commits_on_both_servers(
    vllm_cluster: VllmCluster, tmp_path: Path
) -> None:
    """The weights go over torch.distributed/gloo: a WeightServer in this process (the trainer) serves the version
    from its own directory, which the servers are never told about; each vLLM worker fetches it by its dist:// URI
    through the same verified path (workers.weights.transport.load_verified) and the commit is the usual one."""
    from rolledger.workers.weights.transport import DistStagingStore

    c = vllm_cluster
    before = _snapshot(c)
    version = c.next_version()
    new = c.other_state(seed=500 + version)
    base = max(e.policy_version for e in c.engines)
    store = DistStagingStore(tmp_path / "trainer-only", "127.0.0.1", 0, timeout_s=60)
    committed: list[object] = []
    try:
        staged = store.stage(version, min(base, version - 1), new)
        assert staged.uri.startswith(f"dist://127.0.0.1:{store.server.port}/")
        assert _prepare_all(c, version, staged) == [state_digest(new)] * 2
        # one transfer per rank; the server records one after its send returns, which a rank's finished read may beat
        deadline = time.monotonic() + 30.0
        while len(store.server.served) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the server's record under a deadline
        assert sorted(store.server.served) == [staged.uri.rsplit("/", 1)[1].split("?")[0]] * 2
        for e in c.engines:
            e.pause("wait")
            report = e.commit_weights(version)
            committed.append(e)
            e.resume()
            assert report.weights_digest == state_digest(new) == staged.manifest.weights_digest
        after = _snapshot(c)
        assert all(after[r][1] == state_digest(new) for r in range(2))
        # a byte flipped in transit is refused naming the tensor, and nothing changes
        version2 = c.next_version()
        staged2 = store.stage(version2, version, c.other_state(seed=600 + version2))
        c.engines[0].inject("corrupt-prepare")
        with pytest.raises(WeightValidationError, match="checksum") as info:
            c.engines[0].prepare_from_uri(version2, staged2.uri, staged2.manifest)
        assert info.value.tensor == staged2.manifest.tensors[0].name
        assert _snapshot(c) == after
    finally:
        store.close()
        for e in c.engines:
            e.discard_weights()
            if e in committed:
                e.rollback_weights()
    assert _snapshot(c) == before


def test_vllms_own_update_routes_move_a_version_over_the_registered_rolledger_engine(
    vllm_cluster: VllmCluster, tmp_path: Path
) -> None:
    """The dist transport registered as vLLM's weight-transfer engine `rolledger` (entry point
    vllm.general_plugins): /update_weights receives and verifies a version without touching what serves,
    /finish_weight_update loads it; bytes that do not match the manifest are refused naming the tensor and load
    nothing; a discarded session loads nothing. The live digest proves each step, and loading the start-up weights
    back through the same route gives the start-up live digest again (the route loads exactly the verified bytes)."""
    from rolledger.workers.engines.vllm_http import VllmHttpError
    from rolledger.workers.weights.staging_format import version_dir
    from rolledger.workers.weights.staging_store import build_manifest, prepare_for_save
    from rolledger.workers.weights.transport import DistStagingStore

    c = vllm_cluster
    e = c.engines[0]
    base = c.base_state()
    assert e.weights_digest() == state_digest(base), "the servers should serve the start-up checkpoint between tests"
    start_live = e.live_digest()
    store = DistStagingStore(tmp_path / "trainer", "127.0.0.1", 0, timeout_s=60)

    def update(info: dict[str, object], *, refused: bool = False) -> None:
        # a refusal is an unhandled exception in vLLM's ASGI app: uvicorn answers 500 and closes the connection, so
        # the request that expects one does not leave its connection to be reused
        headers = {"Connection": "close"} if refused else None
        e.http.post("/update_weights", json={"update_info": info}, timeout=120, headers=headers)

    def staged_info(version: int, tensors: dict[str, torch.Tensor]) -> dict[str, object]:
        staged = store.stage(version, version - 1, tensors)
        return {"uri": staged.uri, "version": version, "manifest_digest": staged.manifest_digest}

    try:
        new = c.other_state(seed=700)
        e.http.post("/start_weight_update")
        update(staged_info(c.next_version(), new))
        assert e.live_digest() == start_live, "/update_weights changed what serves before the finish"
        e.http.post("/finish_weight_update", json={"weight_version": None})
        new_live = e.live_digest()
        assert new_live != start_live
        # and what serves computes with the new weights, the tied lm_head's CPU kernel included
        subject = ContractSubject(e, c.base_state, c.other_state, c.stage)
        out = e.generate(subject.prompt, 4, SAMPLED)
        gaps = subject.median_gap(new, out), subject.median_gap(base, out)
        assert gaps[0] * 10 < gaps[1], gaps

        # bytes that are not the manifest's (a transport that delivered the wrong version) load nothing
        wrong_version = c.next_version()
        other = prepare_for_save(c.other_state(seed=701), wrong_version)
        manifest = build_manifest(other, wrong_version, wrong_version - 1, "xxh3_128")
        dirname = version_dir(store.root, wrong_version, manifest.digest).name
        uri = store.server.offer(dirname, manifest, prepare_for_save(new, wrong_version))
        store.server.persisted(dirname)
        e.http.post("/start_weight_update")
        with pytest.raises(VllmHttpError, match="checksum") as info:
            update({"uri": uri, "version": wrong_version, "manifest_digest": manifest.digest}, refused=True)
        assert manifest.tensors[0].name in info.value.message
        with pytest.raises(VllmHttpError, match="without a matching start"):  # vLLM ended the session
            e.http.post("/finish_weight_update", json={"weight_version": None}, headers={"Connection": "close"})
        assert e.live_digest() == new_live

        # received, then discarded (another rank failed): the finish loads nothing
        e.http.post("/start_weight_update")
        update(staged_info(c.next_version(), c.other_state(seed=702)))
        update({"discard": True})
        e.http.post("/finish_weight_update", json={"weight_version": None})
        assert e.live_digest() == new_live

        # the start-up weights back through the same route: exactly the start-up live digest
        e.http.post("/start_weight_update")
        update(staged_info(c.next_version(), base))
        e.http.post("/finish_weight_update", json={"weight_version": None})
        assert e.live_digest() == start_live
    finally:
        store.close()
