"""Interruptible generation: a sample parked by pause("keep") continues across a commit on the new weights, and each
span of its tokens is stamped with the version that produced it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from test_run_loop import execute, of, small

from rolledger.schemas import events as ev
from rolledger.schemas.config import ModelConfig, SamplingParams
from rolledger.workers.engines.protocol import GroupOutput
from rolledger.workers.engines.torch_engine import TorchEngine
from rolledger.workers.policy.grpo import sequence_logprobs
from rolledger.workers.policy.policy_model import build_model, build_tokenizer, policy_state
from rolledger.workflows.audit import audit

T = TypeVar("T")


def test_a_parked_sample_continues_on_the_new_weights_with_stamped_spans() -> None:
    torch.manual_seed(0)
    tok = build_tokenizer()
    cfg = ModelConfig()
    old_model, new_model = build_model(cfg, len(tok), 0), build_model(cfg, len(tok), 1)
    engine = TorchEngine(build_model(cfg, len(tok), 0), tok, interruptible=True)
    prompt = list(tok("12+34=")["input_ids"])
    sampling = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=())
    steps = threading.Semaphore(0)
    result: dict[str, GroupOutput] = {}

    def cancel_hook(_: int) -> bool:
        steps.release()  # one release per sample per decode step: lets the test pause mid-generation
        return False

    def run() -> None:
        result["out"] = engine.generate(prompt, 1, sampling, should_cancel=cancel_hook)

    t = threading.Thread(target=run)
    t.start()
    for _ in range(5):
        assert steps.acquire(timeout=30)
    engine.pause("keep")  # returns once the generation is parked at a decode-step boundary
    engine.stage_weights(1, policy_state(new_model))
    engine.commit_weights(1)
    engine.resume()
    t.join(timeout=60)
    out = result["out"]
    sample = out.samples[0]
    assert len(sample.spans) == 2
    (b0, v0, d0), (b1, v1, d1) = sample.spans
    assert (b0, v0) == (0, 0) and v1 == 1 and 0 < b1 < len(sample.token_ids) and d0 != d1
    # tokens before the boundary were scored by the old weights, after it by the new ones
    lp_old, _ = sequence_logprobs(old_model.eval(), [prompt], [sample.token_ids])
    got = torch.tensor(sample.logprobs)
    assert torch.allclose(got[:b1], lp_old[0, :b1], atol=1e-4)
    # after it the new weights score the tokens (on top of the old weights' KV for the earlier ones, kept as in-flight
    # weight updates do): they no longer match the old model's logprobs
    assert not torch.allclose(got[b1:], lp_old[0, b1 : len(sample.token_ids)], atol=1e-4)
    assert out.policy_version == 1


def test_a_request_taken_before_a_commit_but_batched_after_it_says_the_version_it_was_taken_on_first() -> None:
    """batch_groups: a request the engine took on v waits for the decode thread to take it into the batch. A keep
    pause parks the batch with that request still waiting; a commit to v+1 follows. The request's samples then decode
    entirely on v+1, and each says v in an empty first span: the version the rollout stamped its start with."""
    tok = build_tokenizer()
    cfg = ModelConfig()
    engine = TorchEngine(build_model(cfg, len(tok), 0), tok, interruptible=True, batch_groups=True)
    prompt = list(tok("12+34=")["input_ids"])
    sampling = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=())
    digest0 = engine.weights_digest()
    results: dict[str, GroupOutput] = {}
    pausing: list[threading.Thread] = []

    def submit_b_then_pause(_: int) -> bool:
        """In A's decode step (the decode thread): B is taken by the engine, then the pause lands, before the
        decode thread looks for new requests again."""
        if pausing:
            return False
        b = threading.Thread(target=lambda: results.update(b=engine.generate(prompt, 2, sampling, expect_version=0)))
        b.start()
        deadline = time.monotonic() + 30
        while engine._inflight < 2:  # B taken (counted in flight), not yet in the batch: this thread runs it
            assert time.monotonic() < deadline
            time.sleep(0.001)  # polling the engine's count, with a deadline
        pausing.append(threading.Thread(target=engine.pause, args=("keep",)))
        pausing[0].start()
        while not engine.is_paused:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        pausing.append(b)
        return False

    a = threading.Thread(
        target=lambda: results.update(a=engine.generate(prompt, 1, sampling, should_cancel=submit_b_then_pause))
    )
    a.start()
    deadline = time.monotonic() + 60
    while len(pausing) < 2:
        assert time.monotonic() < deadline, "A's first decode step never ran"
        time.sleep(0.01)
    pausing[0].join(timeout=60)  # parked: A and the waiting B
    engine.stage_weights(1, policy_state(build_model(cfg, len(tok), 1)))
    engine.commit_weights(1)
    digest1 = engine.weights_digest()
    engine.resume()
    a.join(timeout=60)
    pausing[1].join(timeout=60)
    for sample in results["b"].samples:
        assert sample.spans == ((0, 0, digest0), (0, 1, digest1)), sample.spans
        assert len(sample.token_ids) == sampling.max_tokens
    (a_sample,) = results["a"].samples
    assert [v for _, v, _ in a_sample.spans] == [0, 1] and a_sample.spans[1][0] > 0  # A ran on both


@pytest.mark.slow
def test_an_interruptible_run_stamps_spans_and_audits_clean(redis_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = small(
        interruptible=True,
        sampling={"max_tokens": 40, "stop_token_ids": []},
        trainer={"warm_start_steps": 0, "groups_per_step": 2},
    )
    events, summary = execute(redis_url, run_id, tmp_path, cfg)
    assert summary.status == "completed"
    report = audit(events)
    assert report.ok, report.render()
    for t in (p.trajectory for p in of(events, ev.SampleFinished)):
        if t.spans:
            assert [s.policy_version for s in t.spans] == sorted({s.policy_version for s in t.spans})
            assert t.spans[0].start == 0 and t.spans[-1].end == len(t.token_ids)
            assert t.policy_version == t.spans[0].policy_version and len(t.versions) == len(t.spans)


def assert_cut_samples_cancelled_only_in_groups_closed_first(events: list[ev.Event]) -> None:
    """In a run that recycles, a sample an update's drain cut is continued. The only cut samples cancelled are those of
    a group the coordinator closed first: as the run ended (no version left to continue under), or as too stale to
    train (its samples waited out more updates than the lag cap allows). Each is cancelled after that close in the
    log; a group closed *because* its cut samples were cancelled would show them before its GroupCancelled."""
    closed: dict[str, tuple[int, str]] = {}
    for i, e in enumerate(events):
        p = e.payload
        if isinstance(p, ev.GroupCancelled):
            closed.setdefault(p.group_id, (i, p.reason))
        elif isinstance(p, ev.SampleCancelled) and p.reason == "cancelled while generating":
            at, why = closed.get(p.group_id, (len(events), ""))
            assert at < i, f"{p.sample_id} was cut and cancelled (event {i}) while its group was open"
            assert why == "run finished" or why.startswith("stale:"), (p.sample_id, why)


def assert_recycled_across_updates(events: list[ev.Event], engine: str, max_tokens: int) -> int:
    """A recycling run on a real engine: some sample was cut by an update and continued (it has spans), and each
    such sample ran to a natural end on `engine`, with one span per version in order, covering its tokens from the
    first, each version's digest the one its publish named. Returns how many were continued."""
    recycled = [p.trajectory for p in of(events, ev.SampleFinished) if p.trajectory.spans]
    assert recycled, "no sample was cut by an update: the test did not exercise recycling"
    published = {p.version: p.weights_digest for p in of(events, ev.PolicyPublished)}
    for t in recycled:
        assert t.engine == engine and t.finish_reason != "abort"
        versions = [s.policy_version for s in t.spans]
        assert versions == sorted(set(versions)) and len(versions) >= 2
        assert t.spans[0].start == 0 and t.spans[-1].end == len(t.token_ids) <= max_tokens
        assert all(s.weights_digest == published[s.policy_version] for s in t.spans if s.policy_version)
    return len(recycled)


class HeldMidGroupUntilADrain:
    """A test double around a real engine: its first group is held after its first tokens until the engine is paused
    (the next update's drain), so that drain finds it in flight, whenever the update lands. The hold is in the
    group's `should_cancel`, which the decoder asks once per sample per token, between two tokens; what cuts the
    group is the engine's own abort."""

    def __init__(self, inner: object, deadline_s: float = 120.0) -> None:
        self.inner = inner
        self.deadline_s = deadline_s
        self.held = False
        self.prompt: list[int] = []  # the held group's

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def generate(self, prompt: object, n: int, *args: object, **kwargs: object) -> GroupOutput:
        should_cancel = kwargs.get("should_cancel")
        if self.held or n < 2 or not callable(should_cancel):
            return self.inner.generate(prompt, n, *args, **kwargs)  # type: ignore[attr-defined,no-any-return]
        self.held = True
        self.prompt = [int(t) for t in prompt]  # type: ignore[attr-defined]
        asked = 0

        def hold_after_the_first_tokens(i: int) -> bool:
            nonlocal asked
            asked += 1
            if asked == 2 * n + 1:  # every sample has two tokens: wait for the drain's pause
                deadline = time.monotonic() + self.deadline_s
                while not self.inner.is_paused:  # type: ignore[attr-defined]
                    assert time.monotonic() < deadline, f"no drain paused the engine within {self.deadline_s:g} s"
                    time.sleep(0.01)  # polling the engine's pause flag, with a deadline
            return bool(should_cancel(i))

        kwargs["should_cancel"] = hold_after_the_first_tokens
        return self.inner.generate(prompt, n, *args, **kwargs)  # type: ignore[attr-defined,no-any-return]


@pytest.mark.slow
@pytest.mark.parametrize("recycle", [True, False])
def test_samples_an_abort_drain_cuts_are_continued_under_the_new_version_when_the_run_recycles_them(
    redis_url: str, run_id: str, tmp_path: Path, recycle: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """drain_mode "abort" cuts the samples in flight at every update. With `recycle_aborted` each one is continued
    from its own tokens once its rank serves the new version: it finishes with a span per version, none is cancelled
    mid-generation (but as the run ends), and the run audits clean. Without it the same cuts are cancelled samples (the baseline).
    Rank 0's first group is held in flight until the first drain (HeldMidGroupUntilADrain), so some drain cuts
    something however the updates fall (a loaded fresh-clone run once saw six drains cut nothing)."""
    held = double_rank_0(monkeypatch, HeldMidGroupUntilADrain)
    cfg = small(
        recycle_aborted=recycle,
        steps=4,
        sampling={"max_tokens": 40, "stop_token_ids": []},
        trainer={"warm_start_steps": 0, "groups_per_step": 2},
        update={"drain_mode": "abort", "prepare_deadline_s": 20, "drain_deadline_s": 20, "commit_deadline_s": 20},
    )
    events, summary = execute(redis_url, run_id, tmp_path, cfg)
    assert summary.status == "completed"
    report = audit(events)
    assert report.ok, report.render()
    cut = [p for p in of(events, ev.SampleCancelled) if p.reason == "cancelled while generating"]
    recycled = [p.trajectory for p in of(events, ev.SampleFinished) if p.trajectory.spans]
    [double] = held
    group = {p.group_id for p in of(events, ev.GroupAdmitted) if list(p.prompt_token_ids) == double.prompt}
    assert double.held and group, "rank 0 never generated a group"
    if recycle:  # the held group's samples were cut by the first drain and continued
        assert {t.group_id for t in recycled} & group, [(t.group_id, t.spans) for t in recycled]
    else:
        assert {p.group_id for p in cut} & group
    if recycle:
        assert_cut_samples_cancelled_only_in_groups_closed_first(events)
        assert recycled, "no sample was cut by an update: the test did not exercise recycling"
        for t in recycled:
            versions = [s.policy_version for s in t.spans]
            assert versions == sorted(set(versions)) and len(versions) >= 2
            assert t.spans[0].start == 0 and t.spans[-1].end == len(t.token_ids) <= 40 and t.finish_reason != "abort"
    else:
        assert cut and not recycled


def double_rank_0(monkeypatch: pytest.MonkeyPatch, make: Callable[[object], T]) -> list[T]:
    """Put the test double `make` builds around rank 0's engine (inside the run's own fault wrapper) for the runs
    this test starts; the doubles it made, one per engine rank 0 opened."""
    from rolledger.workers.operator import local_run

    real_wrap = local_run.wrap_engine
    made: list[T] = []

    def wrap(engine: object, rank: int, injector: object) -> object:
        inner = real_wrap(engine, rank, injector)  # type: ignore[arg-type]
        if rank != 0:
            return inner
        made.append(make(inner))
        return made[-1]

    monkeypatch.setattr(local_run, "wrap_engine", wrap)
    return made


class PausedBeforeItsFirstRequest:
    """A test double around a real engine: its first `generate` finds the engine paused, as when a drain's pause lands
    between a group's start (its SampleStarted) and its request to the engine. The rank, which did not ask for that
    pause, resumes the engine as it would after any pause it holds no reason for."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.fired = False

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def generate(self, *args: object, **kwargs: object) -> GroupOutput:
        if not self.fired:
            self.fired = True
            self.inner.pause("abort")  # type: ignore[attr-defined]
        return self.inner.generate(*args, **kwargs)  # type: ignore[attr-defined,no-any-return]


@pytest.mark.slow
@pytest.mark.parametrize("recycle", [True, False])
def test_a_group_whose_request_finds_the_engine_paused_is_cut_not_failed(
    redis_url: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recycle: bool
) -> None:
    """The rollout slot started the group, then the engine refused its request (paused): its samples are cut before
    their first token, as the pause would have cut them a moment later. Recycled, they are continued once the rank
    serves again and the group completes; otherwise they are cancelled. None fails as if the engine had broken."""
    double_rank_0(monkeypatch, PausedBeforeItsFirstRequest)
    cfg = small(recycle_aborted=recycle, steps=2, update={"drain_mode": "abort"})
    events, summary = execute(redis_url, run_id, tmp_path, cfg)
    assert summary.status == "completed"
    report = audit(events)
    assert report.ok, report.render()
    assert of(events, ev.SampleFailed) == []
    first = next(p.group_id for p in of(events, ev.SampleStarted) if p.rank == 0)
    finished = [p for p in of(events, ev.SampleFinished) if p.trajectory.group_id == first]
    cancelled = [p for p in of(events, ev.SampleCancelled) if p.group_id == first]
    if recycle:
        assert len(finished) == cfg.group_size and cancelled == []
        assert first in {g for p in of(events, ev.GroupCompleted) for g in [p.group_id]}
    else:
        assert finished == [] and len(cancelled) == cfg.group_size
        assert all(p.reason == "cancelled while generating" for p in cancelled)


class UpdatedBeforeItsFirstRequest:
    """A test double around a real engine: its first `generate` is held until the engine serves a newer version than
    when it was called, as when a whole update commits between a group's start (its SampleStarted, stamped with the
    version the rollout read) and its request to the engine: a keep drain needs only that SampleStarted be in the log,
    so nothing else holds the update back. It records what it held and what served when it let the request through."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.held: tuple[list[int], int, int] | None = None  # (prompt, version when called, version let through on)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def generate(self, *args: object, **kwargs: object) -> GroupOutput:
        if self.held is None:
            before: int = self.inner.policy_version  # type: ignore[attr-defined]
            deadline = time.monotonic() + 120
            # until the update committed and the rank serves again (while paused it would be refused as paused)
            while self.inner.policy_version == before or self.inner.is_paused:  # type: ignore[attr-defined]
                assert time.monotonic() < deadline, f"no update served within 120 s of v{before}"
                time.sleep(0.05)  # polling the engine's version, with a deadline
            self.held = (list(args[0]), before, self.inner.policy_version)  # type: ignore[call-overload,attr-defined]
        return self.inner.generate(*args, **kwargs)  # type: ignore[attr-defined,no-any-return]


@pytest.mark.slow
def test_a_group_whose_request_reaches_the_engine_after_a_whole_update_runs_on_the_version_its_spans_name(
    redis_url: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interruptible run (keep drains). A group's samples are logged as started on v, then an update to v+1 commits
    before its request reaches the engine. The engine refuses the request as stale (it expects v), and the rollout
    continues the samples on v+1 from their first token: each says v in an empty first span and v+1 (or later, in
    spans of their own) for every token.
    Before, the request ran on v+1 and its trajectories said v with no span: tokens from weights their stamp does not
    name, which the audit could not see."""
    doubles = double_rank_0(monkeypatch, UpdatedBeforeItsFirstRequest)
    cfg = small(
        interruptible=True,
        # steps: while the held group runs on after the update it waited out, rank 1 feeds the trainer; the run must
        # not end (cancelling it) first. At 3 steps rank 1 needed only 4 groups in that time, and under the whole
        # suite's load once had them (3 of 4 samples finished); at 5 it needs 8
        steps=5,
        sampling={"max_tokens": 20, "stop_token_ids": []},
        trainer={"warm_start_steps": 0, "groups_per_step": 2},
        admission={"max_lag": 4},  # the held group is not closed as stale by the updates after the one it waited out
    )
    events, summary = execute(redis_url, run_id, tmp_path, cfg)
    assert summary.status == "completed"
    report = audit(events)
    assert report.ok, report.render()
    assert of(events, ev.SampleFailed) == []
    (double,) = doubles
    assert double.held is not None
    prompt, before, after = double.held
    started = {p.group_id: p.policy_version for p in of(events, ev.SampleStarted) if p.rank == 0}
    (group,) = [
        p.group_id
        for p in of(events, ev.GroupAdmitted)
        if p.prompt_token_ids == prompt and started.get(p.group_id) == before
    ]
    finished = [p.trajectory for p in of(events, ev.SampleFinished) if p.trajectory.group_id == group]
    cancelled = [(p.sample_id, p.reason) for p in of(events, ev.SampleCancelled) if p.group_id == group]
    assert len(finished) == cfg.group_size, cancelled
    for t in finished:
        produced = {s.policy_version for s in t.spans if s.end > s.start} if t.spans else {t.policy_version}
        # from v+1 on (a later update may interrupt it again, in its own span); none from v
        assert min(produced) >= after > before, (t.trajectory_id, t.policy_version, t.spans)
        assert t.policy_version == before and t.spans[0].start == t.spans[0].end == 0
