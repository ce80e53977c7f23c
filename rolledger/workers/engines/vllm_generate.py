"""A vLLM rank's generation (`VllmGeneration`, a part of workers.engines.vllm_engine.VllmEngine): a group's samples
in one `/v1/completions` request (workers.engines.vllm_completions), streamed when a sample is awaited before the
group ends (first k, a deadline) and closed once every running sample is cancelled; interruptible: samples cut by a
`pause("keep")` wait, parked, for `resume()`, then continue from their tokens so far in a new request, with a span
where each version begins. Every request is counted in flight, so a pause can wait for them all to come back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rolledger.schemas.config import SamplingParams
from rolledger.workers.engines.protocol import (
    EngineError,
    GroupOutput,
    IllegalEngineOrder,
    SampleOutput,
    refuse_unless_serving,
)
from rolledger.workers.engines.vllm_completions import StreamedChoice, completion_request
from rolledger.workers.engines.vllm_facts import ServerFacts
from rolledger.workers.engines.vllm_http import VllmHttp
from rolledger.workers.engines.vllm_state import VllmRankState


@dataclass
class _GroupRun:
    """One generate call's samples as they stream in, across the requests that continue them after interruptions."""

    prompt: list[int]
    sampling: SamplingParams
    streams: list[StreamedChoice]
    spans: list[list[tuple[int, int, str]]]  # per sample: (first token, version, digest) where each version begins
    continued: int = 0  # continuation requests so far
    prefill_computed: int = 0
    prefill_saved: int = 0


class VllmGeneration:
    """generate and what it needs: the requests of a group, parking, and the in-flight count (a mixin of VllmEngine,
    which sets the attributes below)."""

    rank: int
    model_name: str
    timeout_s: float
    http: VllmHttp
    facts: ServerFacts
    _st: VllmRankState
    _stats_lock: threading.Lock
    _resumed: threading.Condition

    def completion_request(self, prompt_token_ids: Sequence[int], n: int, sampling: SamplingParams) -> dict[str, Any]:
        """The /v1/completions body generate sends (public so benchmarks can send the same request directly)."""
        return completion_request(self.model_name, prompt_token_ids, n, sampling)

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
        """N samples in one request (vLLM prefills the shared prompt once with its prefix cache).

        With `on_sample` (a group that can complete before all its samples end: first k, a deadline) the request is
        streamed: each sample is handed over as it ends, and `should_cancel(i)` is polled at every streamed event.
        Once every sample still running is cancelled (the first k finished, the group closed), the connection is
        closed: vLLM aborts the request, its sequences leave the batch, and the cancelled samples come back with the
        tokens they had (finish_reason "abort"; `stats.cancelled_*` count them). Without it, one plain request:
        streaming would cost a parsed event per token for nothing. Samples cancelled before the request are not sent.

        Interruptible: a `pause("keep")` aborts what the server runs (the server then holds nothing, so the update
        can reset its cache and swap the weights); each sample it cut waits here, parked, until `resume()`, then
        continues from its tokens so far in a new request (prompt + those tokens, the rest of its `max_tokens`),
        under whatever weights serve then, with a span recording where each version begins. Parked past the
        engine's timeout, the samples are returned cut short.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if sampling.logprob_mode != self.facts.logprob_mode:
            raise EngineError(
                f"rank {self.rank}: sampling.logprob_mode={sampling.logprob_mode!r} but the vLLM server computes "
                f"{self.facts.logprobs_mode_raw} (restart it with --logprobs-mode to change)"
            )
        cancel = should_cancel or (lambda _i: False)
        pending = [i for i in range(n) if not cancel(i)]
        with self._resumed:  # checked and counted at once: a pause from here on waits for the request to come back
            self._st.sleep.check_serving("generate", self.rank)
            if self._st.paused:
                raise IllegalEngineOrder(f"rank {self.rank}: generate while paused")
            refuse_unless_serving(expect_version, self._st.policy_version, self.rank)
            self._st.in_flight += bool(pending)
            run = _GroupRun(
                prompt=list(prompt_token_ids),
                sampling=sampling,
                streams=[StreamedChoice(sampling.max_tokens) for _ in range(n)],
                spans=[[(0, self._st.policy_version, self._st.weights_digest)] for _ in range(n)],
            )
        while pending:
            try:
                closed = self._stream(run, pending, cancel, on_sample)
            finally:
                self._came_back()
            if closed:
                break  # every sample still running was cancelled: the request is aborted
            cut = [i for i in pending if run.streams[i].finish == "abort"]
            if not cut or not self._wait_resumed():  # True: resumed, the continuation's request already counted
                break  # all done; or cut by a plain abort (or parked too long): returned cut short
            version, digest = self._st.policy_version, self._st.weights_digest
            for i in cut:
                run.streams[i].reopen()
                start = len(run.streams[i].token_ids)
                if run.spans[i][-1][1:] == (version, digest):
                    continue  # resumed on the same weights (the update aborted): one span goes on
                if run.spans[i][-1][0] == start:
                    run.spans[i][-1] = (start, version, digest)  # cut before its first token there: no empty span
                else:
                    run.spans[i].append((start, version, digest))
            run.continued += 1
            pending = cut
        samples = []
        for i in range(n):
            s = run.streams[i].output()
            samples.append(replace(s, spans=tuple(run.spans[i])) if len(run.spans[i]) > 1 else s)
        st = self._st
        with self._stats_lock:
            st.stats.groups += 1
            st.stats.generated_tokens += sum(len(s.token_ids) for s in samples)
            st.stats.prefill_tokens_computed += run.prefill_computed
            st.stats.prefill_tokens_saved += run.prefill_saved
            st.stats.cancelled_samples += sum(1 for s in samples if s.finish_reason == "abort")
            st.stats.cancelled_tokens += sum(len(s.token_ids) for s in samples if s.finish_reason == "abort")
        return GroupOutput(
            samples=samples,
            policy_version=run.spans[0][0][1],
            weights_digest=run.spans[0][0][2],
            cache_generation=st.cache_generation,
            graph_generation=st.graph_generation,
            prefill_tokens_computed=run.prefill_computed,
            prefill_tokens_saved=run.prefill_saved,
        )

    def _stream(
        self,
        run: _GroupRun,
        pending: list[int],
        cancel: Callable[[int], bool],
        on_sample: Callable[[int, SampleOutput], None] | None,
    ) -> bool:
        """One streamed request for the `pending` samples: the group's first (one prompt, n = len(pending)), or a
        continuation (each sample's prompt + tokens so far, n = 1, the most tokens any of them may still take; each
        is cut at its own budget here). True when it was closed early because every running sample was cancelled."""
        if run.continued == 0:
            body = self.completion_request(run.prompt, len(pending), run.sampling)
        else:
            left = max(run.sampling.max_tokens - len(run.streams[i].token_ids) for i in pending)
            body = self.completion_request(run.prompt, 1, run.sampling.model_copy(update={"max_tokens": left}))
            body["prompt"] = [run.prompt + run.streams[i].token_ids for i in pending]
            if run.sampling.seed is not None:  # the same seed would replay the first request's draws
                body["seed"] = (run.sampling.seed * 1_000_003 + run.continued) % 2**31
        if on_sample is None:  # nobody waits for a sample before the group ends: one plain request
            return self._request(run, pending, body)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        with self.http.stream_events("/v1/completions", body) as events:
            for chunk in events:
                if usage := chunk.get("usage"):
                    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                    run.prefill_saved += cached
                    run.prefill_computed += int(usage.get("prompt_tokens") or 0) - cached
                for c in chunk.get("choices") or ():
                    j = int(c.get("index", -1))
                    if not 0 <= j < len(pending):
                        raise EngineError(f"rank {self.rank}: vLLM streamed choice {j} of {len(pending)}")
                    ended = run.streams[pending[j]].add(c, self.rank)
                    if ended is not None and ended.finish_reason != "abort" and on_sample is not None:
                        i = pending[j]
                        on_sample(i, replace(ended, spans=tuple(run.spans[i])) if len(run.spans[i]) > 1 else ended)
                running = [i for i in pending if run.streams[i].finish is None]
                if running and all(cancel(i) for i in running):
                    return True  # leaving the block closes the connection: vLLM aborts the request
        if any(run.streams[i].finish is None for i in pending):
            raise EngineError(f"rank {self.rank}: vLLM's stream ended before every sample finished")
        return False

    def _request(self, run: _GroupRun, pending: list[int], body: dict[str, Any]) -> bool:
        """`_stream` without streaming: the whole answer at once (samples cut by a pause come back "abort")."""
        answer = self.http.post("/v1/completions", json=body)
        usage = answer.get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        run.prefill_saved += cached
        run.prefill_computed += int(usage.get("prompt_tokens") or 0) - cached
        choices = sorted(answer.get("choices", []), key=lambda c: c["index"])
        if len(choices) != len(pending):
            raise EngineError(f"rank {self.rank}: asked vLLM for {len(pending)} samples, got {len(choices)}")
        for i, c in zip(pending, choices, strict=True):
            run.streams[i].add(c, self.rank)
        return False

    def _wait_resumed(self) -> bool:
        """Samples were cut by the server. Parked by pause("keep"): wait for resume() (True: continue them, the
        continuation's request counted in flight under the same lock, as generate's first one is), unless the engine
        is paused another way meanwhile or its timeout passes (False). Not parked (a plain abort): False."""
        deadline = time.monotonic() + self.timeout_s
        with self._resumed:
            if not (self._st.paused and self._st.pause_mode == "keep"):
                return False
            while self._st.paused:
                left = deadline - time.monotonic()
                if self._st.pause_mode != "keep" or left <= 0:
                    return False
                self._resumed.wait(timeout=left)
            self._st.in_flight += 1
            return True

    def _came_back(self) -> None:
        """A completion request's answer came back (or the request failed): one fewer the server may hold."""
        with self._resumed:
            self._st.in_flight -= 1
            self._resumed.notify_all()
