"""The turns of an episode on a rank (a task with an environment, issue 40): the loop the rollout runs per sample
after the group's first turn, by the rules of workflows/episode.py.

The group's first turn is the group's ordinary request (n samples sharing the prompt, workers/roles/rollout.py).
Then each sample goes on by itself, in a thread of its own (the engine batches their requests as it batches the
slots' groups): its environment answers (`EnvPool.call`, in a process, with the task's timeout), the reply's tokens
are appended with loss mask 0 and logprob 0, and the policy's next turn is one engine request for one sample from
the prompt and every token so far, with at most `next_turn_tokens`. Each turn is recorded (`Turn`: its tokens'
range, its source, and the wall times it began and ended), and the version spans of the policy's turns are joined
(`join_spans`), so an interruptible episode that spans an update says which weights produced which tokens.

An episode ends `Finished` (the environment was done, or a limit was reached), `Failed` (its environment raised, hung
or answered garbage: the error names the environment and the turn, and the rank fails that sample only), or `Cut`
(its group was closed or the engine cut it and it may not go on: cancelled with its tokens). Whether a policy turn
may be requested at all, and what happens when the engine refuses it (an update's drain), is the rollout's
`TurnEngine`: it waits for the engine to serve again where the run allows an episode to span an update
(interruptible or recycle_aborted), and cuts the episode where it does not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig, SamplingParams, TaskConfig
from rolledger.schemas.episode import EnvHistory, EnvReply, EnvTurn
from rolledger.schemas.trajectory import Turn
from rolledger.workers.engines.protocol import GroupOutput, IllegalEngineOrder, SampleOutput
from rolledger.workers.policy.envs import EnvPool
from rolledger.workers.roles.claims import Claim, ClaimLost
from rolledger.workers.roles.sample_events import finished_event, trajectory_of
from rolledger.workers.runtime.runtime import WorkerKilled
from rolledger.workflows.episode import SpanStart, after_reply, join_spans, next_turn_tokens

if TYPE_CHECKING:
    from rolledger.workers.roles.rollout import Rollout


@dataclass(frozen=True)
class Finished:
    """An episode that ended: every token with its mask and logprob, its version spans (empty: one version), its
    turns, and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    spans: tuple[SpanStart, ...]
    turns: tuple[Turn, ...]
    finish_reason: Literal["stop", "length"]


@dataclass(frozen=True)
class Failed:
    error: str  # one line naming the environment and the turn


@dataclass(frozen=True)
class Cut:
    tokens: int  # tokens it had when cut short


EpisodeResult = Finished | Failed | Cut


# The rollout's engine request for one policy turn, (context, sampling) -> the engine's output, or None when the
# episode may not go on (its group closed, the engine cut or refused it and the run does not let it wait).
TurnEngine = Callable[[Sequence[int], SamplingParams], GroupOutput | None]


class Episodes:
    """A rank's episodes: its environment pool and tokenizer (None: the environment must answer token ids)."""

    def __init__(self, task: TaskConfig, tokenizer: Any | None) -> None:
        assert task.env is not None, "Episodes needs a task with an environment"
        self.task = task
        self.tokenizer = tokenizer
        self.pool = EnvPool(task.env, workers=task.env_workers, timeout_s=task.env_timeout_s)

    def close(self) -> None:
        self.pool.close()

    def text(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def reply_tokens(self, reply: EnvReply) -> list[int] | str:
        """The tokens a reply appends, or why it cannot be used."""
        if reply.token_ids is not None:
            return list(reply.token_ids)
        if not reply.text:
            return []
        if self.tokenizer is None:
            return "answered text, but this rank has no tokenizer to encode it (answer token_ids)"
        return list(self.tokenizer(reply.text, add_special_tokens=False)["input_ids"])

    def run(
        self,
        *,
        sample_id: str,
        prompt_id: str,
        prompt_token_ids: Sequence[int],
        answer: str,
        sampling: SamplingParams,
        index: int,
        first: SampleOutput,
        first_on: tuple[int, str],
        began: float,
        ended: float,
        generate: TurnEngine,
        cancelled: Callable[[], bool],
    ) -> EpisodeResult:
        """Sample `index`'s episode after its first turn `first` (generated on `first_on` = (version, digest),
        between the wall times `began` and `ended`): the environment and the policy take turns until it ends."""
        task, env = self.task, self.task.env
        tokens, logprobs = list(first.token_ids), list(first.logprobs)
        mask = [1] * len(tokens)
        spans: list[SpanStart] = list(first.spans) or [(0, *first_on)]
        turns = [Turn(start=0, end=len(tokens), source="policy", began=began, ended=max(began, ended))]
        history = [EnvTurn(source="policy", token_ids=tuple(tokens), text=self.text(tokens))]
        prompt = self.text(prompt_token_ids)
        policy_turns = 1
        while True:
            if cancelled():
                return Cut(len(tokens))
            began = max(time.time(), turns[-1].ended)
            reply = self.pool.call(
                EnvHistory(
                    sample_id=sample_id,
                    prompt_id=prompt_id,
                    prompt=prompt,
                    prompt_token_ids=tuple(prompt_token_ids),
                    answer=answer,
                    turns=tuple(history),
                )
            )
            ended = max(time.time(), began)
            if isinstance(reply, str):
                return Failed(f"environment {env!r} {reply} (answering turn {len(turns) - 1} of {sample_id})")
            ids = self.reply_tokens(reply)
            if isinstance(ids, str):
                return Failed(f"environment {env!r} {ids} (answering turn {len(turns) - 1} of {sample_id})")
            outcome = after_reply(task, len(tokens), policy_turns, len(ids), reply.done)
            if outcome.append:
                turns.append(
                    Turn(start=len(tokens), end=len(tokens) + len(ids), source="env", began=began, ended=ended)
                )
                history.append(EnvTurn(source="env", token_ids=tuple(ids), text=self.text(ids), info=reply.info))
                tokens += ids
                logprobs += [0.0] * len(ids)
                mask += [0] * len(ids)
            if outcome.end is not None:
                return Finished(tokens, logprobs, mask, _spans(spans), tuple(turns), outcome.end)
            if cancelled():
                return Cut(len(tokens))
            k = len(tokens)
            seed = None if sampling.seed is None else (sampling.seed * 1_000_003 + index * 65_537 + k) % 2**31
            turn_sampling = sampling.model_copy(
                update={"max_tokens": next_turn_tokens(task, sampling, k, policy_turns), "seed": seed}
            )
            began = max(time.time(), turns[-1].ended)
            out = generate([*prompt_token_ids, *tokens], turn_sampling)
            ended = max(time.time(), began)
            if out is None:
                return Cut(len(tokens))
            c = out.samples[0]
            spans = join_spans(spans, k, c.spans or ((0, out.policy_version, out.weights_digest),))
            turns.append(Turn(start=k, end=k + len(c.token_ids), source="policy", began=began, ended=ended))
            history.append(EnvTurn(source="policy", token_ids=tuple(c.token_ids), text=self.text(c.token_ids)))
            tokens += c.token_ids
            logprobs += c.logprobs
            mask += [1] * len(c.token_ids)
            policy_turns += 1
            if c.finish_reason == "abort":  # cut inside the turn: its group closed, or a drain cut it
                return Cut(len(tokens))


def _spans(spans: list[SpanStart]) -> tuple[SpanStart, ...]:
    """The span starts a trajectory keeps: none when the whole episode ran on one version."""
    return tuple(spans) if len(spans) > 1 else ()


# ---------------------------------------------------------------- a group's episodes on a rank


def run_group_episodes(
    rollout: Rollout,
    p: ev.GroupAdmitted,
    out: GroupOutput,
    cfg: RunConfig,
    claim: Claim,
    should_cancel: Callable[[int], bool],
    emit: Callable[..., None],
    release: Callable[[int], None] | None,
    stream: bool,
    first_turn: tuple[float, float],
    started: float,
) -> list[ev.Payload]:
    """Every sample's episode after the group's first turn `out` (generated between the wall times
    `first_turn`), each in a thread of its own (workers/roles/episodes.py): the terminal events of those not
    logged as they ended (`stream`: a group that may close early logs each as it ends, so first k completes)."""
    eps = rollout.episodes(cfg)
    may_span = cfg.interruptible or cfg.recycle_aborted  # an episode may go on across an update
    live = [i for i, s in enumerate(out.samples) if s.finish_reason != "abort"]
    gate = _EpisodeGate(rollout, p, claim, len(live))
    one_at_a_time = threading.Lock()  # one sample's events at a time: a producer's ids never go backwards
    results: dict[int, ev.Payload] = {}

    def turn_engine(i: int) -> Callable[[Sequence[int], SamplingParams], GroupOutput | None]:
        def generate(context: Sequence[int], sampling: SamplingParams) -> GroupOutput | None:
            while True:
                try:
                    return rollout.w.engine.generate(
                        context,
                        1,
                        sampling,
                        should_cancel=lambda _: should_cancel(i),
                        # one version per episode unless the run lets it span an update: a commit between two
                        # turns (a keep drain's) is refused, and the episode is cut, not continued on new weights
                        expect_version=None if may_span else out.policy_version,
                    )
                except IllegalEngineOrder:  # paused for an update's drain, or a newer version serves
                    if not may_span or not gate.wait():
                        return None

        return generate

    def episode(i: int) -> None:
        s, sid = out.samples[i], f"{p.group_id}/{i}"
        result: EpisodeResult | ev.Payload
        try:
            result = eps.run(
                sample_id=sid,
                prompt_id=p.prompt_id,
                prompt_token_ids=p.prompt_token_ids,
                answer=p.answer,
                sampling=p.sampling,
                index=i,
                first=s,
                first_on=(out.policy_version, out.weights_digest),
                began=first_turn[0],
                ended=first_turn[1],
                generate=turn_engine(i),
                cancelled=lambda: should_cancel(i),
            )
        except (WorkerKilled, ClaimLost):
            raise
        except Exception as exc:  # noqa: BLE001 - the engine failed on a later turn: this sample fails
            result = ev.SampleFailed(sample_id=sid, group_id=p.group_id, index=i, rank=rollout.w.rank, error=str(exc))
        finally:
            gate.leave()
            if release is not None:
                release(i)
        payload = _payload(rollout, p, i, result, out, (time.perf_counter() - started) * 1e3)
        if stream:
            with one_at_a_time:
                emit(payload)
        else:
            results[i] = payload

    if live:
        name = threading.current_thread().name
        with ThreadPoolExecutor(max_workers=len(live), thread_name_prefix=f"{name}-episode") as pool:
            futures = [pool.submit(episode, i) for i in live]
        for f in futures:
            f.result()  # an injected WorkerKilled or a lost claim ends the slot as it would have
    for i, s in enumerate(out.samples):
        if i not in live:
            results[i] = ev.SampleCancelled(
                sample_id=f"{p.group_id}/{i}",
                group_id=p.group_id,
                index=i,
                reason="cancelled while generating",
                tokens=len(s.token_ids),
            )
    return [results[i] for i in sorted(results)]


def _payload(
    rollout: Rollout, p: ev.GroupAdmitted, i: int, r: EpisodeResult | ev.Payload, out: GroupOutput, gen_ms: float
) -> ev.Payload:
    """The terminal event of sample `i`'s episode."""
    sid = f"{p.group_id}/{i}"
    if isinstance(r, ev.Payload):
        return r
    if isinstance(r, Failed):
        rollout.w.logger.warning("episode failed: its environment", sample=sid, error=r.error)
        return ev.SampleFailed(
            sample_id=sid, group_id=p.group_id, index=i, rank=rollout.w.rank, error=r.error, stage="env"
        )
    if isinstance(r, Cut):
        return ev.SampleCancelled(
            sample_id=sid, group_id=p.group_id, index=i, reason="cancelled while generating", tokens=r.tokens
        )
    assert isinstance(r, Finished)
    s = SampleOutput(r.token_ids, r.logprobs, r.finish_reason, r.spans)
    t = trajectory_of(rollout, p, i, s, out, loss_mask=r.loss_mask, turns=r.turns)
    return finished_event(rollout, p, t, gen_ms)


class _EpisodeGate:
    """A group's share of its rank's running count while its episodes go on: it counts as running while any of
    them generates or waits on its environment, and not while every one left waits for the engine to serve again
    (an update's drain it waits out needs none running), as a recycled group's wait does (`_wait_to_continue`)."""

    def __init__(self, rollout: Rollout, p: ev.GroupAdmitted, claim: Claim, active: int) -> None:
        self.r, self.p, self.claim = rollout, p, claim
        self.active = active  # episodes neither ended nor waiting (under the rank's lock)
        self.waiting = 0

    def wait(self) -> bool:
        """Wait until the rank may generate again; False when the episode may not go on (its group closed or
        reclaimed, the rank stopping)."""
        w = self.r.w
        with w.lock:
            self.active -= 1
            self.waiting += 1
            if self.active == 0:
                w.running -= 1
                w.lock.notify_all()
            try:
                while not (w.stop_event.is_set() or self.claim.lost.is_set() or not self.r._open(self.p.group_id)):
                    if self.r._may_generate() and not w.engine.is_paused:
                        return True
                    w.lock.wait(timeout=0.2)  # woken by every fold of the control thread
                return False
            finally:
                self.waiting -= 1
                self.active += 1
                if self.active == 1:
                    w.running += 1

    def leave(self) -> None:
        """An episode ended."""
        w = self.r.w
        with w.lock:
            self.active -= 1
            if self.active == 0 and self.waiting:
                w.running -= 1
                w.lock.notify_all()
