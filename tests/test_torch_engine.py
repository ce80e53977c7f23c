"""The built-in torch engine against a real tiny Qwen2 model: decoding, prefix cache, sampling, weight updates,
sleep/wake accounting, the order rules, pause/abort/keep and cancellation."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from rolledger.schemas.config import ModelConfig, SamplingParams
from rolledger.workers.engines.protocol import Engine, GroupOutput, IllegalEngineOrder, WeightValidationError
from rolledger.workers.engines.torch_engine import TorchEngine
from rolledger.workers.policy.grpo import sequence_logprobs
from rolledger.workers.policy.policy_model import build_model, build_tokenizer, policy_state
from rolledger.workers.weights.tensors import state_digest

DEADLINE_S = 10.0


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def make_engine(tok: PreTrainedTokenizerFast, seed: int = 0, **kw: Any) -> TorchEngine:
    return TorchEngine(build_model(ModelConfig(), len(tok), seed), tok, **kw)


def prompt(tok: PreTrainedTokenizerFast, text: str = "23+19=") -> list[int]:
    return list(tok(text)["input_ids"])


def wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    ev = threading.Event()
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        ev.wait(0.001)


SEEDED = SamplingParams(temperature=1.0, max_tokens=6, seed=7)


def test_is_an_engine(tok: PreTrainedTokenizerFast) -> None:
    eng = make_engine(tok)
    assert isinstance(eng, Engine)
    caps = eng.capabilities
    assert caps.name == "torch" and caps.sleep_levels == (1, 2) and caps.prefix_cache and caps.logprob_mode == "raw"


def test_prefix_cache_saves_prefill_and_matches_no_cache(tok: PreTrainedTokenizerFast) -> None:
    cached, plain = make_engine(tok), make_engine(tok, prefix_cache=False)
    ids, n = prompt(tok), 8
    first = cached.generate(ids, n, SEEDED)
    assert (first.prefill_tokens_computed, first.prefill_tokens_saved) == (len(ids), (n - 1) * len(ids))
    again = cached.generate(ids, n, SEEDED)
    assert (again.prefill_tokens_computed, again.prefill_tokens_saved) == (0, n * len(ids))
    base = plain.generate(ids, n, SEEDED)
    assert (base.prefill_tokens_computed, base.prefill_tokens_saved) == (n * len(ids), 0)
    for a, b, c in zip(first.samples, again.samples, base.samples):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.logprobs == pytest.approx(c.logprobs, abs=1e-5)
        assert b.logprobs == pytest.approx(c.logprobs, abs=1e-5)
    assert cached.stats.prefill_tokens_computed == len(ids)
    assert cached.stats.prefill_tokens_saved == (2 * n - 1) * len(ids)
    # a longer prompt reuses the longest cached prefix: only the new tail is computed
    longer = ids + prompt(tok, "1")[1:]
    tail = cached.generate(longer, n, SEEDED)
    assert tail.prefill_tokens_computed == 1


def test_shared_prefix_is_reused_across_different_prompts(tok: PreTrainedTokenizerFast) -> None:
    cached, plain = make_engine(tok), make_engine(tok, prefix_cache=False)
    shared = "12+30=42 7+8=15 "
    first, second = prompt(tok, shared + "23+19="), prompt(tok, shared + "23+5=")
    cached.generate(first, 2, SEEDED)
    common = len(prompt(tok, shared + "23+"))  # <bos> + shared text + "23+"
    out = cached.generate(second, 4, SEEDED)
    assert out.prefill_tokens_computed == len(second) - common
    ref = plain.generate(second, 4, SEEDED)
    for a, b in zip(out.samples, ref.samples):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # a prompt that is a strict prefix of a cached one still computes its last token (its logits are not cached)
    assert cached.generate(second[:-1], 1, SEEDED).prefill_tokens_computed == 1


def test_raw_logprobs_match_a_full_forward(tok: PreTrainedTokenizerFast) -> None:
    eng = make_engine(tok)
    ids = prompt(tok)
    out = eng.generate(ids, 4, SEEDED)
    model = build_model(ModelConfig(), len(tok), 0)
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, [ids] * 4, [s.token_ids for s in out.samples])
    for row, s in enumerate(out.samples):
        assert lp[row, : len(s.token_ids)].tolist() == pytest.approx(s.logprobs, abs=1e-5)


def test_processed_logprobs_are_renormalised(tok: PreTrainedTokenizerFast) -> None:
    eng = make_engine(tok)
    ids = prompt(tok)
    raw = eng.generate(ids, 4, SEEDED.model_copy(update={"top_k": 3, "temperature": 0.7}))
    proc = eng.generate(ids, 4, SEEDED.model_copy(update={"top_k": 3, "temperature": 0.7, "logprob_mode": "processed"}))
    assert [s.token_ids for s in raw.samples] == [s.token_ids for s in proc.samples]
    # over a 3-token support sharpened by T<1 every sampled token is more likely than under the full softmax
    for r, p in zip(raw.samples, proc.samples):
        assert all(pl > rl for pl, rl in zip(p.logprobs, r.logprobs))


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 0.7, "top_k": 3},
        {"temperature": 1.3, "top_k": 5, "top_p": 0.8},
        {"temperature": 0.0},
    ],
    ids=["T0.7-p0.9", "T0.7-k3", "T1.3-k5-p0.8", "greedy"],
)
def test_the_trainer_recomputes_processed_logprobs_in_every_sampling_mode(
    tok: PreTrainedTokenizerFast, settings: dict[str, float]
) -> None:
    """The agreement gate compares like with like: processed logprobs against the trainer's processed ones (same
    weights: no gap), never against raw ones (a gap of ~0.27 at T=0.7 that halted clean runs). Other weights still
    show a gap when sampling, so the stale-weights check keeps its teeth."""
    from rolledger.workers.roles.trainer import logprob_agreement

    eng = make_engine(tok)
    ids = prompt(tok)
    sampling = SamplingParams.model_validate({**SEEDED.model_dump(), **settings, "logprob_mode": "processed"})
    out = eng.generate(ids, 8, sampling)
    trajectories = [_trajectory(ids, s.token_ids, s.logprobs, sampling) for s in out.samples]
    same, _ = logprob_agreement(build_model(ModelConfig(), len(tok), 0), trajectories)
    assert same < 1e-5
    other, _ = logprob_agreement(build_model(ModelConfig(), len(tok), 1), trajectories)
    if settings["temperature"] > 0:  # greedy processed logprobs are all 0: they show other weights only where the
        assert other > 1e-2  # argmax moves (the raw mode, or a probe, is the check there)
    raw_view = [msgspec.structs.replace(t, logprob_mode="raw") for t in trajectories]
    if settings["temperature"] not in (0.0, 1.0):  # the old comparison: processed against raw, a false alarm
        assert logprob_agreement(build_model(ModelConfig(), len(tok), 0), raw_view)[0] > 1e-2


def _trajectory(prompt_ids: list[int], token_ids: list[int], logprobs: list[float], sampling: SamplingParams) -> Any:
    from rolledger.schemas.trajectory import Trajectory

    n = len(token_ids)
    fields: dict[str, Any] = {
        "trajectory_id": "g000001/0",
        "group_id": "g000001",
        "prompt_id": "p",
        "index": 0,
        "finish_reason": "length",
        "cache_generation": 0,
        "graph_generation": 0,
        "prompt_token_ids": prompt_ids,
        "token_ids": token_ids,
        "logprobs": logprobs,
        "logprob_mode": sampling.logprob_mode,
        "loss_mask": [1] * n,
        "positions": list(range(len(prompt_ids), len(prompt_ids) + n)),
        "sampling": sampling,
        "policy_version": 0,
        "weights_digest": "w",
        "rank": 0,
        "engine": "torch",
    }
    return Trajectory(**fields)


def test_greedy_and_top_k_one_agree_and_stop_tokens_stop(tok: PreTrainedTokenizerFast) -> None:
    eng = make_engine(tok)
    ids = prompt(tok)
    greedy = eng.generate(ids, 2, SamplingParams(temperature=0.0, max_tokens=6))
    top1 = eng.generate(ids, 2, SamplingParams(temperature=1.0, top_k=1, max_tokens=6, seed=3))
    assert greedy.samples[0].token_ids == greedy.samples[1].token_ids == top1.samples[0].token_ids
    toks = greedy.samples[0].token_ids
    if toks[-1] != tok.eos_token_id:
        assert greedy.samples[0].finish_reason == "length" and len(toks) == 6
    stop_at = toks[1]
    stopped = eng.generate(ids, 1, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(stop_at,)))
    first_stop = toks.index(stop_at)
    assert stopped.samples[0].token_ids == toks[: first_stop + 1]
    assert stopped.samples[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(tok: PreTrainedTokenizerFast) -> None:
    a, b = make_engine(tok), make_engine(tok)
    ids = prompt(tok)
    x, y = a.generate(ids, 8, SEEDED), b.generate(ids, 8, SEEDED)
    assert [s.token_ids for s in x.samples] == [s.token_ids for s in y.samples]
    z = a.generate(ids, 8, SEEDED.model_copy(update={"seed": 8}))
    assert [s.token_ids for s in z.samples] != [s.token_ids for s in x.samples]


def test_bad_requests_name_the_field(tok: PreTrainedTokenizerFast) -> None:
    eng = make_engine(tok)
    with pytest.raises(ValueError, match="max_tokens"):
        eng.generate(prompt(tok), 1, SamplingParams(max_tokens=64))
    with pytest.raises(ValueError, match="vocabulary"):
        eng.generate([1, 999], 1, SEEDED)
    with pytest.raises(ValueError, match="n must be"):
        eng.generate(prompt(tok), 0, SEEDED)


def test_stage_rejects_bad_tensors_and_leaves_live_weights(tok: PreTrainedTokenizerFast) -> None:
    eng = make_engine(tok)
    before = eng.weights_digest()
    good = policy_state(build_model(ModelConfig(), len(tok), 1))
    name = "model.layers.0.mlp.up_proj.weight"
    cases = {
        "shape": {**good, name: torch.zeros(3, 3)},
        "dtype": {**good, name: good[name].to(torch.bfloat16)},
        "NaN": {**good, name: torch.full_like(good[name], float("nan"))},
        "missing": {k: v for k, v in good.items() if k != name},
    }
    for reason, tensors in cases.items():
        with pytest.raises(WeightValidationError, match=reason) as err:
            eng.stage_weights(1, tensors)
        assert err.value.tensor == name, reason
    with pytest.raises(WeightValidationError, match="not a tensor of the live model") as err:
        eng.stage_weights(1, {**good, "extra.weight": torch.zeros(1)})
    assert err.value.tensor == "extra.weight"
    assert eng.weights_digest() == before
    assert eng.staged_version is None
    with pytest.raises(IllegalEngineOrder, match="nothing staged"):
        eng.commit_weights(1)


def test_commit_swaps_weights_and_invalidates_the_cache(tok: PreTrainedTokenizerFast) -> None:
    eng = make_engine(tok)
    ids = prompt(tok)
    old = eng.generate(ids, 4, SEEDED)
    new_model = build_model(ModelConfig(), len(tok), 1)
    staged_digest = eng.stage_weights(1, policy_state(new_model))
    assert staged_digest == state_digest(policy_state(new_model))
    assert eng.weights_digest() == old.weights_digest  # staging never touches the live weights
    with pytest.raises(IllegalEngineOrder, match="v1 is staged"):
        eng.commit_weights(2)
    report = eng.commit_weights(1)
    assert report.weights_digest == staged_digest == eng.weights_digest() != old.weights_digest
    assert report.policy_version == eng.policy_version == 1
    assert report.cache_generation == old.cache_generation + 1
    assert report.graph_generation == old.graph_generation and not report.graphs_invalidated
    after = eng.generate(ids, 4, SEEDED)
    assert after.prefill_tokens_computed == len(ids)  # the old prefix KV is gone
    assert (after.policy_version, after.weights_digest, after.cache_generation) == (1, staged_digest, 1)
    fresh = TorchEngine(build_model(ModelConfig(), len(tok), 1), tok).generate(ids, 4, SEEDED)
    assert [s.token_ids for s in after.samples] == [s.token_ids for s in fresh.samples]
    eng.stage_weights(2, policy_state(new_model))
    eng.discard_weights()
    with pytest.raises(IllegalEngineOrder):
        eng.commit_weights(2)


def test_sleep_level_1_releases_and_wake_restores(tok: PreTrainedTokenizerFast) -> None:
    eng = make_engine(tok)
    ids = prompt(tok)
    before_out = eng.generate(ids, 4, SEEDED)
    digest = eng.weights_digest()
    held = eng.accounted_bytes()
    param_bytes = sum(
        p.numel() * p.element_size() for p in policy_state(build_model(ModelConfig(), len(tok), 0)).values()
    )
    assert held > param_bytes  # weights + the cached prompt KV
    report = eng.sleep(1)
    assert report.verified and report.bytes_before == held and report.bytes_after == 0 == eng.accounted_bytes()
    assert eng.host_bytes() == param_bytes and eng.asleep_level == 1
    with pytest.raises(IllegalEngineOrder, match="asleep"):
        eng.generate(ids, 1, SEEDED)
    with pytest.raises(IllegalEngineOrder, match="never update weights while asleep"):
        eng.stage_weights(1, policy_state(build_model(ModelConfig(), len(tok), 1)))
    with pytest.raises(IllegalEngineOrder, match="kv_cache before weights"):
        eng.wake(["kv_cache"])
    with pytest.raises(IllegalEngineOrder, match="already asleep"):
        eng.sleep(2)
    woke = eng.wake(["weights"])
    assert woke.bytes_restored == param_bytes and eng.accounted_bytes() == param_bytes
    with pytest.raises(IllegalEngineOrder, match="kv_cache"):
        eng.generate(ids, 1, SEEDED)  # kv_cache still asleep
    eng.wake(["kv_cache"])
    assert eng.asleep_level == 0 and eng.weights_digest() == digest and eng.host_bytes() == 0
    after_out = eng.generate(ids, 4, SEEDED)
    assert after_out.prefill_tokens_computed == len(ids)  # the prefix cache was dropped by the sleep
    assert [s.token_ids for s in after_out.samples] == [s.token_ids for s in before_out.samples]


def test_sleep_level_2_needs_new_weights(tok: PreTrainedTokenizerFast) -> None:
    eng = make_engine(tok)
    ids = prompt(tok)
    report = eng.sleep(2)
    assert report.verified and report.bytes_after == 0 and eng.host_bytes() == 0
    woke = eng.wake(["weights", "kv_cache"])
    assert woke.tags == ("weights", "kv_cache") and woke.bytes_restored > 0
    with pytest.raises(IllegalEngineOrder, match="committed"):
        eng.generate(ids, 1, SEEDED)  # reallocated but uninitialised
    assert not eng.health().ok
    new = policy_state(build_model(ModelConfig(), len(tok), 3))
    digest = eng.stage_weights(5, new)  # allowed: the weights tag is awake
    assert eng.commit_weights(5).weights_digest == digest
    assert eng.health().ok
    assert eng.generate(ids, 2, SEEDED).policy_version == 5


def test_sleep_refused_with_staged_weights(tok: PreTrainedTokenizerFast) -> None:
    eng = make_engine(tok)
    eng.stage_weights(1, policy_state(build_model(ModelConfig(), len(tok), 1)))
    with pytest.raises(IllegalEngineOrder, match="staged"):
        eng.sleep(1)
    with pytest.raises(ValueError, match="level"):
        eng.sleep(3)


def test_health_probe(tok: PreTrainedTokenizerFast) -> None:
    model = build_model(ModelConfig(), len(tok), 0)
    eng = TorchEngine(model, tok)
    other = make_engine(tok)
    a, b = eng.health(), other.health()
    assert a.ok and a.probe_digest == b.probe_digest != ""
    model.model.norm.weight.data.fill_(float("nan"))  # corrupt the live weights behind the engine's back
    bad = eng.health()
    assert not bad.ok and "non-finite" in bad.detail


def test_pause_refuses_generate_until_resume(tok: PreTrainedTokenizerFast) -> None:
    eng = make_engine(tok)
    eng.pause("wait")
    assert eng.is_paused
    with pytest.raises(IllegalEngineOrder, match="paused"):
        eng.generate(prompt(tok), 1, SEEDED)
    eng.resume()
    assert not eng.is_paused
    assert len(eng.generate(prompt(tok), 1, SEEDED).samples) == 1


def _run_blocked_generate(
    eng: TorchEngine, tok: PreTrainedTokenizerFast, block_at_call: int
) -> tuple[threading.Thread, threading.Event, dict[str, GroupOutput | BaseException]]:
    """Start generate on a worker thread whose should_cancel blocks at its Nth poll until `proceed` is set."""
    reached, proceed = threading.Event(), threading.Event()
    calls = [0]
    result: dict[str, GroupOutput | BaseException] = {}

    def should_cancel(i: int) -> bool:
        if i == 0:
            calls[0] += 1
            if calls[0] == block_at_call:
                reached.set()
                assert proceed.wait(DEADLINE_S)
        return False

    def work() -> None:
        try:
            result["out"] = eng.generate(
                prompt(tok), 8, SamplingParams(max_tokens=30, seed=1), should_cancel=should_cancel
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            result["error"] = exc

    worker = threading.Thread(target=work)
    worker.start()
    assert reached.wait(DEADLINE_S)
    return worker, proceed, result


def test_pause_abort_ends_a_running_generate(tok: PreTrainedTokenizerFast) -> None:
    eng = make_engine(tok)
    worker, proceed, result = _run_blocked_generate(eng, tok, block_at_call=3)
    pauser = threading.Thread(target=eng.pause, args=("abort",))
    pauser.start()
    wait_until(lambda: eng.is_paused, "pause to take effect")
    proceed.set()
    worker.join(DEADLINE_S)
    pauser.join(DEADLINE_S)
    assert not worker.is_alive() and not pauser.is_alive()
    out = result["out"]
    assert isinstance(out, GroupOutput)
    reasons = [s.finish_reason for s in out.samples]
    assert "abort" in reasons and "length" not in reasons
    assert all(len(s.token_ids) <= 3 for s in out.samples)
    eng.resume()
    assert eng.generate(prompt(tok), 1, SEEDED).samples


def test_pause_keep_then_commit_aborts_the_parked_generate(tok: PreTrainedTokenizerFast) -> None:
    eng = make_engine(tok)
    worker, proceed, result = _run_blocked_generate(eng, tok, block_at_call=2)
    pauser = threading.Thread(target=eng.pause, args=("keep",))
    pauser.start()
    wait_until(lambda: eng.is_paused, "pause to take effect")
    proceed.set()
    pauser.join(DEADLINE_S)  # returns once the generate is parked (model lock released)
    assert not pauser.is_alive() and worker.is_alive()
    with pytest.raises(IllegalEngineOrder, match="in flight"):
        eng.sleep(1)
    eng.stage_weights(1, policy_state(build_model(ModelConfig(), len(tok), 1)))
    eng.commit_weights(1)  # possible while parked: the parked samples must not continue on new weights
    eng.resume()
    worker.join(DEADLINE_S)
    assert not worker.is_alive()
    out = result["out"]
    assert isinstance(out, GroupOutput)
    assert out.policy_version == 0
    assert "abort" in [s.finish_reason for s in out.samples]


def test_should_cancel_aborts_one_sample(tok: PreTrainedTokenizerFast) -> None:
    eng = make_engine(tok)
    out = eng.generate(prompt(tok), 4, SamplingParams(max_tokens=6, seed=2), should_cancel=lambda i: i == 1)
    assert out.samples[1].finish_reason == "abort" and out.samples[1].token_ids == []
    assert all(s.finish_reason in ("stop", "length") for k, s in enumerate(out.samples) if k != 1)


def test_cancelled_and_finished_samples_leave_the_decode_batch(tok: PreTrainedTokenizerFast) -> None:
    """Three of four samples are cancelled after their third token (a first k reached): every decode step after it
    computes only the samples still running (the batch of each forward call, counted on the model), not four rows."""
    model = build_model(ModelConfig(), len(tok), 0)
    rows: list[int] = []
    forward = model.forward

    @functools.wraps(forward)
    def counting(*args: Any, **kwargs: Any) -> Any:
        rows.append(int(kwargs["input_ids"].shape[0]))
        return forward(*args, **kwargs)

    model.forward = counting  # type: ignore[method-assign]  # counts the batch of each call
    eng = TorchEngine(model, tok, prefix_cache=False)
    polls = [0, 0, 0, 0]

    def cancel(i: int) -> bool:  # polled once per step per running sample, before its token of that step
        polls[i] += 1
        return i != 0 and polls[i] > 3

    out = eng.generate(prompt(tok), 4, SamplingParams(max_tokens=12, seed=5), should_cancel=cancel)
    lengths = [len(s.token_ids) for s in out.samples]
    assert [s.finish_reason for s in out.samples[1:]].count("abort") >= 1
    assert all(n == 3 for s, n in zip(out.samples, lengths, strict=True) if s.finish_reason == "abort")
    decode = rows[1:]  # rows[0] is the prefill; decode call s feeds the tokens drawn at step s
    expected = [
        sum(
            1
            for s, n in zip(out.samples, lengths, strict=True)
            if n >= step + 2 or (s.finish_reason == "abort" and n == step + 1)
        )
        for step in range(len(decode))
    ]
    assert decode == expected
    assert decode[0] == 4 and min(decode) < 4  # rows did leave the batch


def test_closed_engine_refuses(tok: PreTrainedTokenizerFast) -> None:
    eng = make_engine(tok)
    eng.close()
    with pytest.raises(Exception, match="closed"):
        eng.generate(prompt(tok), 1, SEEDED)
    assert not eng.health().ok
