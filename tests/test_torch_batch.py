"""The torch engine with `batch_groups`: groups generated at once share one decode batch (workers/engines/torch_batch).

Each test holds the engine's model lock while its groups are submitted, so the decode thread takes them all in one
batch: which groups share a step is then fixed, not a race. What the tests hold the batch to:
- a group computes in a batch what it computes alone (same seeded tokens, logprobs within float error), whatever the
  other groups' prompt lengths, and the engine's counters say the groups shared steps;
- a group closed early (first k reached) ends its running samples "abort" with the tokens they had, and its rows
  leave the batch while the other groups run on unchanged;
- a caller whose on_sample raises gets that exception; the other groups finish;
- pause("abort") ends every group of the batch; pause("keep") parks them all (pause returns) and resume continues
  them to the same tokens as an uninterrupted run;
- a group is stamped with the weights that generated it, even when a commit lands before its caller takes it back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from engine_contract import generate_in_thread
from transformers import PreTrainedTokenizerFast

from rolledger.schemas.config import ModelConfig, SamplingParams
from rolledger.workers.engines.protocol import GroupOutput, PauseMode, SampleOutput
from rolledger.workers.engines.torch_engine import TorchEngine
from rolledger.workers.policy.policy_model import build_model, build_tokenizer, policy_state

DEADLINE_S = 30.0
TEXTS = ("1+2=", "23+19=", "12+30=42 7+8=15 23+5=")  # three prompt lengths: the batch pads the shorter ones


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def make_engine(tok: PreTrainedTokenizerFast, **kw: Any) -> TorchEngine:
    return TorchEngine(build_model(ModelConfig(), len(tok), 0), tok, **kw)


def ids(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(tok(text)["input_ids"])


def wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    tick = threading.Event()
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        tick.wait(0.001)  # polling a condition under a deadline


def together(engine: TorchEngine, calls: list[Callable[[], GroupOutput]]) -> list[GroupOutput | BaseException]:
    """Run `calls` on threads so that the decode thread takes them as one batch; their results or exceptions."""
    results: list[GroupOutput | BaseException | None] = [None] * len(calls)

    def run(k: int) -> None:
        try:
            results[k] = calls[k]()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            results[k] = exc

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(len(calls))]
    with engine._model_lock:  # the decode thread waits here until every call is submitted
        for t in threads:
            t.start()
        wait_until(lambda: len(engine._pending) == len(calls), "every call submitted")
    for t in threads:
        t.join(DEADLINE_S)
        assert not t.is_alive(), "a batched generate did not return"
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def sampling(seed: int, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed)


def assert_same(a: GroupOutput, b: GroupOutput) -> None:
    for x, y in zip(a.samples, b.samples, strict=True):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == y.finish_reason
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def test_groups_of_different_prompt_lengths_compute_in_a_batch_what_they_compute_alone(
    tok: PreTrainedTokenizerFast,
) -> None:
    alone = make_engine(tok)
    batched = make_engine(tok, batch_groups=True)
    try:
        prompts = [ids(tok, t) for t in TEXTS]
        expected = [alone.generate(p, 3, sampling(seed=k)) for k, p in enumerate(prompts)]
        got = together(batched, [partial(batched.generate, p, 3, sampling(seed=k)) for k, p in enumerate(prompts)])
        for e, g in zip(expected, got, strict=True):
            assert isinstance(g, GroupOutput), g
            assert_same(g, e)
        assert batched.stats.extra["batch_max_groups"] == 3
        assert batched.stats.groups == 3
        # greedy too: the same argmax with the other groups' padding in the batch
        greedy = SamplingParams(temperature=0.0, max_tokens=12)
        expected = [alone.generate(p, 2, greedy) for p in prompts]
        got = together(batched, [partial(batched.generate, p, 2, greedy) for p in prompts])
        for e, g in zip(expected, got, strict=True):
            assert isinstance(g, GroupOutput), g
            assert_same(g, e)
    finally:
        alone.close()
        batched.close()


def test_max_batch_groups_bounds_every_step_and_a_waiting_group_computes_what_it_computes_alone(
    tok: PreTrainedTokenizerFast,
) -> None:
    alone = make_engine(tok)
    limited = make_engine(tok, batch_groups=True, max_batch_groups=2)
    try:
        prompts = [ids(tok, t) for t in TEXTS]
        expected = [alone.generate(p, 3, sampling(seed=k)) for k, p in enumerate(prompts)]
        got = together(limited, [partial(limited.generate, p, 3, sampling(seed=k)) for k, p in enumerate(prompts)])
        for e, g in zip(expected, got, strict=True):
            assert isinstance(g, GroupOutput), g
            assert_same(g, e)
        assert limited.stats.extra["batch_max_groups"] == 2  # three submitted at once, never more than two a step
        assert limited.stats.groups == 3
    finally:
        alone.close()
        limited.close()


def test_a_group_waiting_for_room_whose_samples_are_all_cancelled_ends_before_its_first_token(
    tok: PreTrainedTokenizerFast,
) -> None:
    alone = make_engine(tok)
    engine = make_engine(tok, batch_groups=True, max_batch_groups=1)
    try:
        long_run = SamplingParams(temperature=1.0, max_tokens=40, seed=1, stop_token_ids=[])
        p_run, p_wait = ids(tok, TEXTS[0]), ids(tok, TEXTS[2])
        expected = alone.generate(p_run, 2, long_run)
        running, waiting = threading.Event(), threading.Event()

        def hold_until_the_other_waits(i: int) -> bool:  # the running group's check, on the decode thread
            if not waiting.is_set():
                running.set()  # the decode thread took this group and runs it: the other is submitted only now,
                wait_until(lambda: len(engine._pending) == 1, "the second group submitted")  # so it must wait
                waiting.set()
            return False

        runs, ran = generate_in_thread(
            lambda: engine.generate(p_run, 2, long_run, should_cancel=hold_until_the_other_waits)
        )
        # submitted together, the decode thread could take both at once and end the cut one before the running
        # group's first check, which would then wait for a submission already gone
        assert running.wait(DEADLINE_S)
        waits, waited = generate_in_thread(lambda: engine.generate(p_wait, 3, long_run, should_cancel=lambda i: True))
        for t in (waits, runs):
            t.join(DEADLINE_S)
            assert not t.is_alive()
        cut, full = waited[0], ran[0]
        assert isinstance(cut, GroupOutput) and isinstance(full, GroupOutput), (cut, full)
        assert [s.finish_reason for s in cut.samples] == ["abort"] * 3
        assert all(s.token_ids == [] for s in cut.samples)
        assert cut.prefill_tokens_computed == 0  # never prefilled: it had no room in the batch before it was cut
        assert_same(full, expected)
        assert engine.stats.extra["batch_max_groups"] == 1
    finally:
        alone.close()
        engine.close()


def test_a_closed_group_leaves_the_batch_and_the_others_run_on_unchanged(tok: PreTrainedTokenizerFast) -> None:
    alone = make_engine(tok)
    batched = make_engine(tok, batch_groups=True)
    try:
        long_run = SamplingParams(temperature=1.0, max_tokens=40, seed=1, stop_token_ids=[])
        p_keep, p_cut = ids(tok, TEXTS[0]), ids(tok, TEXTS[2])
        expected = alone.generate(p_keep, 2, long_run)
        steps: dict[int, int] = {}

        def closed(i: int) -> bool:  # polled once per running sample per step: closed at the sixth step
            steps[i] = steps.get(i, 0) + 1
            return max(steps.values()) > 5

        keep, cut = together(
            batched,
            [
                lambda: batched.generate(p_keep, 2, long_run),
                lambda: batched.generate(p_cut, 4, long_run, should_cancel=closed),
            ],
        )
        assert isinstance(keep, GroupOutput) and isinstance(cut, GroupOutput), (keep, cut)
        assert_same(keep, expected)
        running = [s for s in cut.samples if s.finish_reason == "abort"]
        assert running, [s.finish_reason for s in cut.samples]
        assert all(len(s.token_ids) == 5 for s in running), [len(s.token_ids) for s in running]
        assert batched.stats.cancelled_samples == len(running)
        assert batched.stats.cancelled_tokens == 5 * len(running)
    finally:
        alone.close()
        batched.close()


def test_a_caller_whose_on_sample_raises_gets_its_exception_and_the_other_groups_finish(
    tok: PreTrainedTokenizerFast,
) -> None:
    batched = make_engine(tok, batch_groups=True)
    try:
        short = SamplingParams(temperature=1.0, max_tokens=3, seed=2, stop_token_ids=[])
        longer = SamplingParams(temperature=1.0, max_tokens=30, seed=3)
        handed: list[int] = []

        def lost(i: int, s: SampleOutput) -> None:
            raise RuntimeError(f"claim lost at sample {i}")

        bad, good = together(
            batched,
            [
                lambda: batched.generate(ids(tok, TEXTS[1]), 2, short, on_sample=lost),
                lambda: batched.generate(ids(tok, TEXTS[0]), 2, longer, on_sample=lambda i, s: handed.append(i)),
            ],
        )
        assert isinstance(bad, RuntimeError) and "claim lost at sample" in str(bad)
        assert isinstance(good, GroupOutput), good
        assert sorted(handed) == [0, 1]
        # the engine serves on: a later group is decoded normally
        after = batched.generate(ids(tok, TEXTS[0]), 1, longer)
        assert len(after.samples[0].token_ids) > 0
    finally:
        batched.close()


def pause_mid_batch(
    engine: TorchEngine,
    calls: Callable[[Callable[[int], bool]], list[Callable[[], GroupOutput]]],
    mode: PauseMode,
    at_step: int,
) -> tuple[threading.Thread, list[GroupOutput | BaseException]]:
    """Run `calls(check)` as one batch; at a sample's `at_step`-th step the decode thread waits in `check`, mid-sample,
    until pause(mode) has been asked. Returns once pause returned: the batch's thread and its results (filled when
    the batch ends)."""
    steps: dict[int, int] = {}
    reached, go = threading.Event(), threading.Event()

    def check(i: int) -> bool:
        steps[i] = steps.get(i, 0) + 1
        if steps[i] == at_step and not reached.is_set():
            reached.set()
            assert go.wait(DEADLINE_S)
        return False

    results: list[GroupOutput | BaseException] = []
    t = threading.Thread(target=lambda: results.extend(together(engine, calls(check))), daemon=True)
    t.start()
    assert reached.wait(DEADLINE_S)
    pauser = threading.Thread(target=engine.pause, args=(mode,), daemon=True)
    pauser.start()
    wait_until(lambda: engine.is_paused, "pause asked for")
    go.set()
    pauser.join(DEADLINE_S)  # "abort": no generation is in flight; "keep": the whole batch is parked
    assert not pauser.is_alive()
    return t, results


def test_pause_abort_ends_every_group_of_the_batch(tok: PreTrainedTokenizerFast) -> None:
    batched = make_engine(tok, batch_groups=True)
    try:
        long_run = SamplingParams(temperature=1.0, max_tokens=40, seed=4, stop_token_ids=[])
        t, results = pause_mid_batch(
            batched,
            lambda check: [
                partial(batched.generate, ids(tok, text), 2, long_run, should_cancel=check)
                for text in (TEXTS[0], TEXTS[2])
            ],
            "abort",
            at_step=2,
        )
        t.join(DEADLINE_S)
        assert not t.is_alive() and len(results) == 2
        for out in results:
            assert isinstance(out, GroupOutput), out
            reasons = [s.finish_reason for s in out.samples]
            assert "abort" in reasons and "length" not in reasons, reasons
            assert all(len(s.token_ids) <= 2 for s in out.samples), [len(s.token_ids) for s in out.samples]
        batched.resume()
        assert len(batched.generate(ids(tok, TEXTS[0]), 1, long_run).samples[0].token_ids) > 2
    finally:
        batched.close()


def test_pause_keep_parks_the_whole_batch_and_resume_continues_it(tok: PreTrainedTokenizerFast) -> None:
    alone = make_engine(tok)
    batched = make_engine(tok, batch_groups=True)
    try:
        run_params = [SamplingParams(temperature=1.0, max_tokens=30, seed=5 + k, stop_token_ids=[]) for k in range(2)]
        prompts = [ids(tok, TEXTS[0]), ids(tok, TEXTS[2])]
        expected = [alone.generate(p, 2, s) for p, s in zip(prompts, run_params, strict=True)]
        t, results = pause_mid_batch(
            batched,
            lambda check: [
                partial(batched.generate, p, 2, s, should_cancel=check)
                for p, s in zip(prompts, run_params, strict=True)
            ],
            "keep",
            at_step=3,
        )
        assert t.is_alive()  # parked, not finished
        batched.resume()
        t.join(DEADLINE_S)
        assert not t.is_alive()
        for out, e in zip(results, expected, strict=True):
            assert isinstance(out, GroupOutput), out
            assert_same(out, e)
    finally:
        alone.close()
        batched.close()


def test_a_group_is_stamped_with_the_weights_that_generated_it_when_a_commit_follows_at_once(
    tok: PreTrainedTokenizerFast,
) -> None:
    """The batch stamps a group (weights digest, cache and graph generations) when it ends, under the model lock: a
    commit that lands before the caller has taken the group back does not stamp it with weights it never saw."""
    engine = make_engine(tok, batch_groups=True)
    before = engine.weights_digest()
    entered, committed = threading.Event(), threading.Event()

    def on_sample(i: int, s: SampleOutput) -> None:
        entered.set()
        assert committed.wait(DEADLINE_S)  # the caller holds the group back until the commit is in

    caller, got = generate_in_thread(
        lambda: engine.generate(ids(tok, TEXTS[0]), 1, sampling(1, max_tokens=4), on_sample=on_sample)
    )
    assert entered.wait(DEADLINE_S)
    new = {k: v + 0.01 for k, v in policy_state(engine._model).items()}
    engine.stage_weights(1, new)
    report = engine.commit_weights(1)  # takes the model lock: after the decode thread has let go of the group
    committed.set()
    caller.join(DEADLINE_S)
    assert got and isinstance(got[0], GroupOutput), got
    assert report.weights_digest != before
    assert (got[0].policy_version, got[0].weights_digest) == (0, before)
    engine.close()
