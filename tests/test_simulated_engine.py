"""The simulated engine (workers/engines/simulated_engine.py): declared lengths, cancellation that frees a sample at
once and counts its tokens as wasted, one clock shared by concurrent groups, and pause("keep") continuing under the
new version. Time is asserted on the engine's own step counter (`sim_steps`), never on the wall clock; threads are
synchronised with events, never sleeps."""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rolledger.schemas.config import ConfigError, ModelConfig, RunConfig, SamplingParams, SimulatedConfig
from rolledger.workers.engines.protocol import GroupOutput, IllegalEngineOrder, SampleOutput
from rolledger.workers.engines.simulated_engine import SimulatedEngine
from rolledger.workers.engines.simulated_samples import sample_length
from rolledger.workers.policy.policy_model import build_model, build_tokenizer, policy_state

CONFIG = ModelConfig()


def engine(lengths: tuple[int, ...] = (), *, step_s: float = 0.002, interruptible: bool = False) -> SimulatedEngine:
    tok = build_tokenizer()
    cfg = SimulatedConfig(step_s=step_s, prefill_s_per_token=0.0, lengths=lengths)
    return SimulatedEngine(build_model(CONFIG, len(tok), seed=0), tok, cfg, interruptible=interruptible)


def sampling(max_tokens: int = 4000, seed: int = 7) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed)


PROMPT = [1, 4, 5, 14, 6, 15]


def in_thread(fn: Callable[[], GroupOutput]) -> tuple[threading.Thread, list[GroupOutput]]:
    got: list[GroupOutput] = []
    t = threading.Thread(target=lambda: got.append(fn()), daemon=True)
    t.start()
    return t, got


def test_lengths_are_as_declared_and_end_with_eos_or_at_the_cap() -> None:
    e = engine((3, 5, 1, 12))
    out = e.generate(PROMPT, 4, sampling(max_tokens=10))
    assert [len(s.token_ids) for s in out.samples] == [3, 5, 1, 10]
    assert [s.finish_reason for s in out.samples] == ["stop", "stop", "stop", "length"]
    eos = build_tokenizer().eos_token_id
    for s in out.samples:
        assert len(s.logprobs) == len(s.token_ids)
        assert all(x < 0 for x in s.logprobs)
        assert eos not in s.token_ids[:-1] and all(t >= 3 or t == eos for t in s.token_ids)
    assert [s.token_ids[-1] == eos for s in out.samples] == [True, True, True, False]
    assert e.stats.generated_tokens == 19 and e.tokens_wasted == 0
    assert e.capabilities.name == "simulated"
    e.close()


def test_the_lognormal_lengths_are_seeded_capped_and_have_the_declared_median() -> None:
    cfg = SimulatedConfig(length_median=200, length_sigma=1.0, prompt_sigma=0.0)
    draws = [sample_length(cfg, PROMPT, seed, i, 4000) for seed in range(250) for i in range(8)]
    assert draws == [sample_length(cfg, PROMPT, seed, i, 4000) for seed in range(250) for i in range(8)]
    assert 180 <= statistics.median(draws) <= 220
    assert max(draws) <= 4000 and min(draws) >= 1
    assert max(sample_length(cfg, PROMPT, s, 0, 300) for s in range(100)) == 300  # the cap is max_tokens
    # a prompt's own factor: every sample of one prompt moves together
    by_prompt = SimulatedConfig(length_median=200, length_sigma=0.0, prompt_sigma=1.0)
    assert len({sample_length(by_prompt, PROMPT, s, i, 4000) for s in range(5) for i in range(8)}) == 1
    assert sample_length(by_prompt, PROMPT, 0, 0, 4000) != sample_length(by_prompt, [1, 9, 9], 0, 0, 4000)


def test_a_cancelled_sample_leaves_at_once_and_its_tokens_are_wasted() -> None:
    e = engine((5, 400), step_s=0.005)
    first_done = threading.Event()
    seen_at: list[float] = []

    def on_sample(i: int, s: SampleOutput) -> None:
        if i == 0:
            first_done.set()

    def should_cancel(i: int) -> bool:
        if i == 1 and first_done.is_set():
            if not seen_at:
                seen_at.append(e.sim_steps)
            return True
        return False

    out = e.generate(PROMPT, 2, sampling(), should_cancel=should_cancel, on_sample=on_sample)
    done, cut = out.samples
    assert (len(done.token_ids), done.finish_reason) == (5, "stop")
    assert cut.finish_reason == "abort"
    assert 5 <= len(cut.token_ids) <= seen_at[0] + 3  # stopped at the step the cancel was seen, not at 400
    assert e.sim_steps < 50  # the group ended then: the straggler's slot was freed at once
    assert e.tokens_wasted == len(cut.token_ids)
    assert e.stats.generated_tokens == 5 + len(cut.token_ids)
    e.close()


def test_concurrent_groups_advance_together_on_one_clock() -> None:
    e = engine((100, 100, 100, 100), step_s=0.004)
    started = threading.Event()

    def first_in_flight(_: int) -> bool:
        started.set()
        return False

    a, got_a = in_thread(lambda: e.generate(PROMPT, 4, sampling(seed=1), should_cancel=first_in_flight))
    assert started.wait(30)
    b, got_b = in_thread(lambda: e.generate(PROMPT, 4, sampling(seed=2)))
    a.join(30)
    b.join(30)
    assert len(got_a[0].samples) == len(got_b[0].samples) == 4
    assert e.peak_sequences == 8  # both groups were in the batch at once
    # one group takes 100 steps; two one after the other would take 200: together they take about one group's
    assert 100 <= e.sim_steps < 150
    e.close()


def test_pause_keep_parks_and_continues_under_the_new_version_with_spans() -> None:
    e = engine((60, 60), step_s=0.003, interruptible=True)
    polls = threading.Semaphore(0)

    def count(_: int) -> bool:
        polls.release()
        return False

    t, got = in_thread(lambda: e.generate(PROMPT, 2, sampling(), should_cancel=count))
    for _ in range(10):  # in flight for a few polls
        assert polls.acquire(timeout=30)
    old = e.weights_digest()
    e.pause("keep")
    frozen = e.sim_steps
    new = {k: v + 0.01 for k, v in policy_state(build_model(CONFIG, len(build_tokenizer()), seed=0)).items()}
    e.stage_weights(1, new)
    report = e.commit_weights(1)
    assert e.sim_steps == frozen  # the clock stands still while the batch is parked
    e.resume()
    t.join(30)
    out = got[0]
    assert out.policy_version == 1
    for s in out.samples:
        assert len(s.token_ids) == 60 and s.finish_reason == "stop"
        (b0, v0, d0), (b1, v1, d1) = s.spans
        assert (b0, v0, d0) == (0, 0, old)
        assert 0 < b1 < 60 and (v1, d1) == (1, report.weights_digest)
    e.close()


def test_without_interruptible_a_version_change_while_parked_aborts() -> None:
    e = engine((200,), step_s=0.003)
    polls = threading.Semaphore(0)

    def count(_: int) -> bool:
        polls.release()
        return False

    t, got = in_thread(lambda: e.generate(PROMPT, 1, sampling(), should_cancel=count))
    assert polls.acquire(timeout=30)
    e.pause("keep")
    e.stage_weights(
        1, {k: v.clone() for k, v in policy_state(build_model(CONFIG, len(build_tokenizer()), seed=0)).items()}
    )
    e.commit_weights(1)
    e.resume()
    t.join(30)
    (s,) = got[0].samples
    assert s.finish_reason == "abort" and e.tokens_wasted == len(s.token_ids) < 200
    e.close()


def test_pause_abort_ends_in_flight_samples_and_generate_is_refused_until_resume() -> None:
    e = engine((500, 500), step_s=0.003)
    polls = threading.Semaphore(0)

    def count(_: int) -> bool:
        polls.release()
        return False

    t, got = in_thread(lambda: e.generate(PROMPT, 2, sampling(), should_cancel=count))
    assert polls.acquire(timeout=30)
    e.pause("abort")  # returns once nothing is in flight
    t.join(30)
    assert [s.finish_reason for s in got[0].samples] == ["abort", "abort"]
    assert e.tokens_wasted == sum(len(s.token_ids) for s in got[0].samples)
    with pytest.raises(IllegalEngineOrder, match="paused"):
        e.generate(PROMPT, 1, sampling())
    with pytest.raises(IllegalEngineOrder, match="in flight"):
        _sleep_while_in_flight(e)
    e.close()


def _sleep_while_in_flight(e: SimulatedEngine) -> None:
    """sleep() is refused while a generation is in flight (one is made to be, under pause keep)."""
    e.resume()
    polls = threading.Semaphore(0)

    def count(_: int) -> bool:
        polls.release()
        return False

    t, _ = in_thread(lambda: e.generate(PROMPT, 1, sampling(), should_cancel=count))
    assert polls.acquire(timeout=30)
    e.pause("keep")
    try:
        e.sleep(1)
    finally:
        e.pause("abort")
        t.join(30)


def test_the_weights_transaction_is_the_real_engines() -> None:
    e = engine((4,))
    base = e.generate(PROMPT, 1, sampling()).samples[0]
    new = {k: v * 0.5 for k, v in policy_state(build_model(CONFIG, len(build_tokenizer()), seed=3)).items()}
    digest = e.stage_weights(1, new)
    assert e.policy_version == 0 and e.generate(PROMPT, 1, sampling()).samples[0] == base
    report = e.commit_weights(1)
    assert report.weights_digest == digest == e.weights_digest()
    assert e.health().ok
    out = e.generate(PROMPT, 1, sampling())
    assert (out.policy_version, out.weights_digest) == (1, digest)
    assert out.samples[0].token_ids != base.token_ids  # other weights serve other tokens
    bad = dict(new)
    bad["model.embed_tokens.weight"] = torch.zeros(3, 3)
    with pytest.raises(Exception, match="embed_tokens"):
        e.stage_weights(2, bad)
    e.close()


def test_an_invalid_simulated_value_is_refused_in_one_line_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "run.toml"
    bad.write_text('engine = "simulated"\n[simulated]\nstep_s = -0.045\n')
    with pytest.raises(ConfigError) as info:
        RunConfig.load(bad)
    assert "simulated.step_s" in str(info.value) and "\n" not in str(info.value)
    assert RunConfig.model_validate({"engine": "simulated"}).simulated.step_s == 0.045


def capped(lengths: tuple[int, ...], max_num_seqs: int, step_s: float = 0.002) -> SimulatedEngine:
    tok = build_tokenizer()
    cfg = SimulatedConfig(step_s=step_s, prefill_s_per_token=0.0, lengths=lengths, max_num_seqs=max_num_seqs)
    return SimulatedEngine(build_model(CONFIG, len(tok), seed=0), tok, cfg)


def test_max_num_seqs_bounds_the_batch_and_a_waiting_sequence_joins_as_one_ends() -> None:
    """Two sequences at once: 4 x 30 tokens take 60 steps, not 30; and beside a 100-token straggler the four short
    samples take the other room one after another (steps 0-10, 10-20, 20-30, 30-40): 100 steps in all, as continuous
    batching (vLLM's max_num_seqs) schedules them."""
    e = capped((30,), 2)
    out = e.generate(PROMPT, 4, sampling())
    assert [len(s.token_ids) for s in out.samples] == [30] * 4
    assert e.peak_running == 2 and e.peak_sequences == 4
    assert 60 <= e.sim_steps < 90
    e.close()
    straggler = capped((10, 100, 10, 10, 10), 2)
    ended: list[int] = []
    out = straggler.generate(PROMPT, 5, sampling(), on_sample=lambda i, _s: ended.append(i))
    assert [len(s.token_ids) for s in out.samples] == [10, 100, 10, 10, 10]
    assert ended == [0, 2, 3, 4, 1]  # the short ones end in turn in the room the straggler leaves
    assert 100 <= straggler.sim_steps < 130
    straggler.close()
    unbounded = capped((30,), 0)
    unbounded.generate(PROMPT, 4, sampling())
    assert unbounded.sim_steps < 45 and unbounded.peak_running == 4  # 0: every sequence decodes at once
    unbounded.close()


def test_a_group_waits_for_room_another_group_leaves_and_a_cancelled_waiting_sample_has_no_tokens() -> None:
    e = capped((30,), 4)
    started = threading.Event()

    def first_in_flight(_: int) -> bool:
        started.set()
        return False

    a, got_a = in_thread(lambda: e.generate(PROMPT, 4, sampling(seed=1), should_cancel=first_in_flight))
    assert started.wait(30)
    b, got_b = in_thread(lambda: e.generate(PROMPT, 4, sampling(seed=2), should_cancel=lambda i: i == 3))
    a.join(30)
    b.join(30)
    assert [len(s.token_ids) for s in got_a[0].samples] == [30] * 4
    # b's samples waited for a's room (4 at once): three decoded after it, the fourth was cancelled while waiting
    assert [len(s.token_ids) for s in got_b[0].samples] == [30, 30, 30, 0]
    assert got_b[0].samples[3].finish_reason == "abort"
    assert e.peak_running == 4 and e.tokens_wasted == 0
    assert 60 <= e.sim_steps < 90  # 30 steps for a, then 30 for b: the batch never held more than 4
    e.close()


def test_sequence_capacity_below_one_group_is_refused_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "run.toml"
    bad.write_text('engine = "simulated"\nrank_capacity = "sequences"\n[simulated]\nmax_num_seqs = 4\n')
    with pytest.raises(ConfigError) as info:
        RunConfig.load(bad)
    assert "below group_size=8" in str(info.value) and "\n" not in str(info.value)
