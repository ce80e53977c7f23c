"""A SIMULATED engine, for benchmarks of the control plane: tokens cost declared time, not a model's compute.

`SimulatedEngine` is a whole Engine (workers/engines/protocol.py), so the real control plane drives it unchanged: the rank's
rollout slots, the log, the update transaction and the trainer API. Only generation is simulated; everything else is
a real `TorchEngine` over a tiny real policy (workers.policy.policy_model), to which it delegates: prepare/stage/commit/
discard with every checksum, the weights digest, the health probe (a real forward pass), sleep/wake. Its capabilities
say `name="simulated"`, and every trajectory it produces is stamped `engine="simulated"`.

How time is simulated (`SimulatedConfig`, config section `simulated`; all times multiplied by `time_scale`):
- Continuous batching on one clock per engine: every sequence in flight, from every concurrent `generate` call (a
  rank's rollout slots call it at once), gains one token per decode step of `step_s`, however many are in flight (the
  memory-bound decode regime; how many groups a rank runs at once is bounded by the run's `rank_slots`), up to
  `max_num_seqs` sequences at once (0: unbounded): beyond it a sequence waits, first come first served, and joins the
  batch at the virtual instant a running one ends or is cut (vLLM's scheduler with max_num_seqs), so the engine's
  token throughput is at most max_num_seqs / step_s; `peak_running` is the most in the batch at once. The clock is
  virtual time: it runs (at wall-clock speed) while any sequence is in flight and stands still while the engine is
  idle or paused with "keep"; `sim_steps` counts its decode steps (busy time / step). A group's prompt is prefilled
  once (a shared prefix) in `prefill_s_per_token` x prompt tokens, beside the decode batch; its samples then decode.
- What each sample is, drawn and never computed (its declared length, its tokens and logprobs, NOT a model's):
  workers.engines.simulated_samples.

Control, as TorchEngine's rules (IllegalEngineOrder otherwise): generate is refused while paused, asleep or before
new weights were committed after a level-2 sleep. `should_cancel(i)` is polled every `cancel_poll_steps` decode steps
(default every step); a cancelled sample leaves the batch at once, its tokens so far counted as wasted. pause("abort")
ends the unfinished samples at their next poll ("abort", wasted); pause("wait") lets them run to their end and returns
when none is in flight; pause("keep") stops the clock and parks every generation until resume, then they continue:
under the new version with a span per version when the engine is interruptible, else their unfinished samples end
with "abort" rather than mix versions. Samples are streamed (`on_sample` as each ends), so a first-k group completes
and cancels its stragglers while they run. sleep is refused with generations in flight.

No lock is held across a group: a generation waits on the engine's condition with deadlines (its next sample's end,
its next poll), and callbacks (`should_cancel`, `on_sample`) are called with no engine lock held.

Counters (`stats`, plus `sim_steps`, `tokens_wasted`, `peak_sequences`): tokens generated (finished and cancelled),
tokens wasted by cancellation or abort, the most sequences in flight at once.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from rolledger.schemas.config import SamplingParams, SimulatedConfig
from rolledger.schemas.weights import WeightManifest
from rolledger.workers.engines.protocol import (
    CommitReport,
    EngineCapabilities,
    EngineError,
    EngineStats,
    GroupOutput,
    HealthReport,
    IllegalEngineOrder,
    PauseMode,
    SampleOutput,
    SleepReport,
    TensorSpec,
    WakeReport,
    WakeTag,
    refuse_unless_serving,
)
from rolledger.workers.engines.simulated_samples import FinishReason, sample_length, sample_tokens
from rolledger.workers.engines.torch_engine import TorchEngine


@dataclass(eq=False)
class _Sample:
    target: int  # declared length
    ends_at: float  # virtual time its last token is produced (inf while it waits for room in the batch)
    spans: list[tuple[int, int, str]]
    done: SampleOutput | None = None
    ready_at: float = 0.0  # virtual time its prefill is done: it may join the batch from then


class SimulatedEngine:
    """A simulated-time Engine over a real TorchEngine for everything but generation (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        cfg: SimulatedConfig,
        *,
        rank: int = 0,
        policy_version: int = 0,
        interruptible: bool = False,
        cancel_poll_steps: int = 1,
        pause_timeout_s: float = 60.0,
        keep_timeout_s: float = 300.0,
    ) -> None:
        if cancel_poll_steps < 1:
            raise ValueError(f"cancel_poll_steps must be >= 1 (got {cancel_poll_steps})")
        self.rank = rank
        self.cfg = cfg
        self.interruptible = interruptible
        self.step_s = cfg.step_s * cfg.time_scale
        self.prefill_s_per_token = cfg.prefill_s_per_token * cfg.time_scale
        self._poll_s = self.step_s * cancel_poll_steps
        self._inner = TorchEngine(
            model, tokenizer, rank=rank, policy_version=policy_version, prefix_cache=False, interruptible=interruptible
        )
        self._eos_id = int(tokenizer.eos_token_id)
        self._vocab = int(cast(Any, model).config.vocab_size)  # an HF causal LM
        self._digest = self._inner.weights_digest()
        self._pause_timeout_s = pause_timeout_s
        self._keep_timeout_s = keep_timeout_s

        self._cv = threading.Condition()  # every field below; notified on every change
        self._paused: PauseMode | None = None
        self._abort = False
        self._closed = False
        self._inflight = 0  # generate calls in flight
        self._parked = 0  # of which parked under pause("keep")
        self._active = 0  # sequences in flight (all calls)
        self._vt = 0.0  # virtual (busy) time, seconds, up to `_since`
        self._since: float | None = None  # monotonic time the clock last started; None while it stands still
        self._batch: list[_Sample] = []  # max_num_seqs only: the sequences decoding (their room is taken)
        self._waiting: list[_Sample] = []  # ... and those waiting for room, in arrival order
        self.peak_sequences = 0
        self.peak_running = 0  # the most sequences decoding at once
        self.tokens_wasted = 0
        self.stats = EngineStats()

    # ------------------------------------------------------------------ what it is

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            name="simulated",
            sleep_levels=(1, 2),
            prefix_cache=False,
            logprob_mode="raw",
            interruptible=self.interruptible,
            streams_samples=True,
        )

    @property
    def policy_version(self) -> int:
        return self._inner.policy_version

    @property
    def cache_generation(self) -> int:
        return self._inner.cache_generation

    @property
    def graph_generation(self) -> int:
        return self._inner.graph_generation

    @property
    def is_paused(self) -> bool:
        with self._cv:
            return self._paused is not None

    @property
    def asleep_level(self) -> int:
        return self._inner.asleep_level

    def kv_cache_tokens(self) -> int | None:
        """`simulated.kv_cache_tokens`, the KV cache this rank says it has (None when 0: none reported)."""
        return self.cfg.kv_cache_tokens or None

    @property
    def sim_steps(self) -> float:
        """Decode steps the clock has run (virtual busy time / step_s)."""
        with self._cv:
            return self._now() / self.step_s

    # ------------------------------------------------------------------ the clock (caller holds self._cv)

    def _now(self) -> float:
        return self._vt + (time.monotonic() - self._since if self._since is not None else 0.0)

    def _retime(self) -> None:
        """Start or stop the clock: it runs while a sequence is in flight and the engine is not paused with keep."""
        run = self._active > 0 and self._paused != "keep" and not self._closed
        if run and self._since is None:
            self._since = time.monotonic()
        elif not run and self._since is not None:
            self._vt = self._now()
            self._since = None

    def _tokens_at(self, s: _Sample, t: float) -> int:
        if math.isinf(s.ends_at):  # still waiting for room in the batch: nothing decoded
            return 0
        return max(0, min(s.target, math.floor((t - (s.ends_at - s.target * self.step_s)) / self.step_s + 1e-9)))

    # ------------------------------------------------------------------ the batch's room (caller holds self._cv)

    def _fill(self, t: float) -> None:
        """Room freed at virtual time `t`: the waiting sequences join the batch, first come first served, each
        decoding from `t` (or its prefill's end, if later)."""
        cap = self.cfg.max_num_seqs
        while self._waiting and (not cap or len(self._batch) < cap):
            s = self._waiting.pop(0)
            s.ends_at = max(t, s.ready_at) + s.target * self.step_s
            self._batch.append(s)
        self.peak_running = max(self.peak_running, len(self._batch) if cap else self._active)

    def _advance(self, now: float) -> None:
        """Replay the batch up to `now`: each sequence that ended by then gave its room, at its end, to the next
        waiting one (in order of their ends), so the schedule is the same whichever thread looks first."""
        while self._waiting and self._batch:
            first = min(self._batch, key=lambda s: s.ends_at)
            if first.ends_at > now:
                break
            self._batch.remove(first)
            self._fill(first.ends_at)
        self._batch = [s for s in self._batch if s.ends_at > now and s.done is None]

    def _leave(self, s: _Sample, now: float) -> None:
        """Sequence `s` was cut (cancelled, aborted) at `now`: its room goes to the next waiting one."""
        if s in self._waiting:
            self._waiting.remove(s)
        elif s in self._batch:
            self._batch.remove(s)
            self._fill(now)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        n: int,
        sampling: SamplingParams,
        *,
        should_cancel: Callable[[int], bool] | None = None,
        on_sample: Callable[[int, SampleOutput], None] | None = None,
        expect_version: int | None = None,
    ) -> GroupOutput:
        prompt = [int(t) for t in prompt_token_ids]
        if n < 1:
            raise ValueError(f"n must be >= 1 (got {n})")
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        bad = [t for t in prompt if not 0 <= t < self._vocab]
        if bad:
            raise ValueError(f"prompt_token_ids holds ids outside the vocabulary [0, {self._vocab}): {bad[:5]}")
        targets = [sample_length(self.cfg, prompt, sampling.seed, i, sampling.max_tokens) for i in range(n)]
        with self._cv:
            if self._closed:
                raise EngineError(f"rank {self.rank}: engine is closed")
            if self._paused is not None:
                raise IllegalEngineOrder(f"rank {self.rank}: generate while paused ({self._paused})")
            self._check_serving("generate")
            version, digest = self._inner.policy_version, self._digest
            refuse_unless_serving(expect_version, version, self.rank)
            now = self._now()
            start = now + self.prefill_s_per_token * len(prompt)
            samples = [_Sample(k, start + k * self.step_s, [(0, version, digest)], ready_at=start) for k in targets]
            if self.cfg.max_num_seqs:  # each waits for room; those that fit join the batch at once
                self._advance(now)
                for s in samples:
                    s.ends_at = math.inf
                self._waiting.extend(samples)
                self._fill(now)
            self._inflight += 1
            self._active += n
            self.peak_sequences = max(self.peak_sequences, self._active)
            if not self.cfg.max_num_seqs:
                self.peak_running = self.peak_sequences
            self._retime()
        try:
            version = self._run(samples, sampling, version, should_cancel, on_sample)
        finally:
            with self._cv:
                self._active -= sum(1 for s in samples if s.done is None)
                for s in samples:
                    if s.done is None:  # only on an exception: end them as aborted
                        self._leave(s, self._now())
                        s.done = SampleOutput([], [], "abort")
                self._inflight -= 1
                self._retime()
                self._cv.notify_all()
        outs = [s.done for s in samples if s.done is not None]
        with self._cv:
            self.stats.groups += 1
            self.stats.generated_tokens += sum(len(s.token_ids) for s in outs)
            self.stats.prefill_tokens_computed += len(prompt)
            self.stats.prefill_tokens_saved += (n - 1) * len(prompt)
        return GroupOutput(
            samples=outs,
            policy_version=version,
            weights_digest=self._digest,
            cache_generation=self._inner.cache_generation,
            graph_generation=self._inner.graph_generation,
            prefill_tokens_computed=len(prompt),
            prefill_tokens_saved=(n - 1) * len(prompt),
        )

    def _check_serving(self, what: str) -> None:
        """Caller holds self._cv."""
        self._inner.sleep_state.check_serving(what, self.rank)  # the real engine's per-tag state

    def _run(
        self,
        samples: list[_Sample],
        sampling: SamplingParams,
        version: int,
        should_cancel: Callable[[int], bool] | None,
        on_sample: Callable[[int, SampleOutput], None] | None,
    ) -> int:
        """Advance this group on the engine's clock until every sample ended; the version it ended on."""
        live = set(range(len(samples)))
        while live:
            ended: list[int] = []
            with self._cv:
                abort = self._abort
                if not abort and self._paused == "keep":
                    abort = not self._park()
                now = self._now()
                self._advance(now)
                serving = self._inner.policy_version
                if not abort and serving != version:  # committed while these samples ran
                    if self.interruptible:
                        version = serving
                        for i in live:
                            if samples[i].ends_at > now:
                                samples[i].spans.append((self._tokens_at(samples[i], now), version, self._digest))
                    else:
                        abort = True  # never mix versions in one sample
                for i in sorted(live):
                    s = samples[i]
                    if s.ends_at <= now:
                        reason: FinishReason = "length" if s.target >= sampling.max_tokens else "stop"
                        s.done = self._output(s, sampling, i, s.target, reason)
                    elif abort:
                        s.done = self._output(s, sampling, i, self._tokens_at(s, now), "abort")
                        self._leave(s, now)
                    else:
                        continue
                    ended.append(i)
                    self._active -= 1
                live.difference_update(ended)
                self._retime()
            for i in ended:
                out = samples[i].done
                if on_sample is not None and out is not None and out.finish_reason != "abort":
                    on_sample(i, out)
            if not live:
                break
            cancelled = [i for i in sorted(live) if should_cancel is not None and should_cancel(i)]
            with self._cv:
                now = self._now()
                for i in cancelled:
                    s = samples[i]
                    if s.ends_at <= now:
                        continue  # it ended before the cancel was seen: the next pass finishes it
                    s.done = self._output(s, sampling, i, self._tokens_at(s, now), "abort")
                    self._leave(s, now)
                    live.discard(i)
                    self._active -= 1
                self._retime()
                if not live:
                    break
                next_end = min(samples[i].ends_at for i in live)
                if math.isinf(next_end) and self._batch:  # all waiting for room: the next room is the next end
                    next_end = min(s.ends_at for s in self._batch)
                self._wait_next(next_end, now)
        return version

    def _wait_next(self, next_end: float, now: float) -> None:
        """Caller holds self._cv: sleep until the next sample's end or the next poll, whichever is first; woken early
        by every change (pause, commit, close). A clock that stands still (paused with keep) is woken by resume."""
        if self._abort or self._paused == "keep":
            return
        left = min(next_end, now + self._poll_s) - now
        if left > 0:
            self._cv.wait(left)

    def _park(self) -> bool:
        """Caller holds self._cv, paused with keep: wait for resume (or abort, close, the deadline). False: end the
        unfinished samples with "abort"."""
        deadline = time.monotonic() + self._keep_timeout_s
        self._parked += 1
        self._cv.notify_all()
        try:
            while self._paused == "keep" and not self._abort:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        finally:
            self._parked -= 1
            self._cv.notify_all()
        return not self._abort and self._inner.sleep_state.serving

    def _output(
        self, s: _Sample, sampling: SamplingParams, index: int, tokens: int, reason: FinishReason
    ) -> SampleOutput:
        """Caller holds self._cv: the sample's first `tokens` tokens, counted (and as wasted when it was cut short)."""
        ids, logprobs = sample_tokens(sampling.seed, index, s.spans[0][2], tokens, self._vocab, self._eos_id, reason)
        if reason == "abort":
            self.tokens_wasted += tokens
        spans = (s.spans[0], *(sp for sp in s.spans[1:] if sp[0] < tokens))  # no empty span at the end
        return SampleOutput(
            token_ids=ids, logprobs=logprobs, finish_reason=reason, spans=spans if len(spans) > 1 else ()
        )

    # ------------------------------------------------------------------ pause / resume

    def pause(self, mode: PauseMode, *, timeout_s: float | None = None) -> None:
        """Stop admitting generations; return when in-flight ones are quiescent (see the module docstring)."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep' (got {mode!r})")
        deadline = time.monotonic() + (self._pause_timeout_s if timeout_s is None else timeout_s)
        with self._cv:
            if self._closed:
                raise EngineError(f"rank {self.rank}: engine is closed")
            self._paused = mode
            self._abort = self._abort or mode == "abort"
            self._retime()
            self._cv.notify_all()
            while not (self._inflight == 0 or (mode == "keep" and self._parked == self._inflight)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(
                        f"rank {self.rank}: pause({mode!r}) timed out with {self._inflight} generation(s) in flight"
                    )
                self._cv.wait(left)

    def resume(self) -> None:
        with self._cv:
            if self._closed:
                raise EngineError(f"rank {self.rank}: engine is closed")
            self._paused = None
            self._abort = False
            self._retime()
            self._cv.notify_all()

    # ------------------------------------------------------------------ sleep / wake (the real engine's)

    def sleep(self, level: int) -> SleepReport:
        with self._cv:
            if self._inflight:
                raise IllegalEngineOrder(
                    f"rank {self.rank}: sleep({level}) with {self._inflight} generation(s) in flight; pause first"
                )
            return self._inner.sleep(level)

    def wake(self, tags: Sequence[WakeTag]) -> WakeReport:
        with self._cv:
            return self._inner.wake(tags)  # level 2: the weights are invalid until a commit (its sleep_state)

    # ------------------------------------------------------------------ weights (the real engine's)

    def live_tensor_specs(self) -> Mapping[str, TensorSpec]:
        return self._inner.live_tensor_specs()

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> str:
        return self._inner.stage_weights(version, tensors)

    def prepare(self, version: int, uri: str, manifest: WeightManifest) -> str:
        return self._inner.prepare(version, uri, manifest)

    def commit_weights(self, version: int) -> CommitReport:
        with self._cv:
            report = self._inner.commit_weights(version)
            self._digest = report.weights_digest
            self._cv.notify_all()
            return report

    def discard_weights(self) -> None:
        self._inner.discard_weights()

    @property
    def staged_version(self) -> int | None:
        return self._inner.staged_version

    def reset_prefix_cache(self) -> int:
        return self._inner.reset_prefix_cache()

    def weights_digest(self) -> str:
        with self._cv:
            self._check_serving("weights_digest")
        return self._inner.weights_digest()

    def health(self) -> HealthReport:
        return self._inner.health()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._abort = True
            self._retime()
            self._cv.notify_all()
        self._inner.close()
