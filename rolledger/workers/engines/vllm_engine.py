"""The vLLM engine: one inference rank, a vLLM server driven over HTTP (workers.engines.vllm_http).

`VllmEngine` implements workers.engines.protocol.Engine against a vLLM OpenAI server started with VLLM_SERVER_DEV_MODE=1 and
`--worker-extension-cls rolledger.workers.weights.vllm_extension.RolledgerWorkerExtension` (workers.engines.vllm_server
launches one):

- generate: `POST /v1/completions` with the prompt as token ids, `n`, `logprobs=0`, `return_token_ids=true`
  (workers.engines.vllm_completions); the logprob mode (raw or processed) is read from the server's config and
  reported in `capabilities`. A rank's rollout slots (`rank_slots`) call it at once, each its own request on the
  shared connection pool (workers.engines.vllm_http), so the server batches their groups together.
- pause/resume: `/pause?mode=`, `/resume`, `/is_paused`. While paused (by this engine) `generate` is refused.
- weights: the HTTP engine cannot hand tensors over in memory, so the update goes through the staging store:
  `prepare_from_uri(version, uri, manifest)` makes every vLLM worker read and validate the staged update into its
  own host buffer (collective_rpc `rolledger_prepare`); `commit_weights` swaps it in on every worker
  (`rolledger_commit`, which rolls itself back on failure), then sets `/update_weight_version` (checked with
  `GET /weight_info`) and resets the prefix cache. `stage_weights(version, tensors)` writes the tensors to a private
  temporary staging directory and calls `prepare_from_uri`: correct for a server on this host, but a trainer should
  stage once and call `prepare_from_uri` on every rank.
- sleep/wake only when the server runs with sleep mode (detected from its config); on CPU vLLM refuses sleep mode,
  so `sleep`/`wake` raise EngineError saying so and `capabilities.sleep_levels == ()`. The sleep state is kept per
  tag (workers.engines.sleep_state): `/wake_up?tags=weights` lets an update be prepared and committed while the KV
  cache still sleeps (vLLM's RL order), weights are never sent while they sleep, and a wake sends only tags that
  sleep (vLLM wakes nothing when asked for one that does not).
- errors: every failed route is an EngineError naming the route and the server (workers.engines.vllm_http), and so
  is an HTTP 200 with `success: false` (`/reset_prefix_cache`) or a worker answering `ok: false`.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import xxhash

from rolledger.schemas.config import SamplingParams
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
    WeightValidationError,
    cut_until_answered,
    refuse_unless_serving,
)
from rolledger.workers.engines.sleep_state import SleepState, level_2_refusal
from rolledger.workers.engines.vllm_completions import StreamedChoice, completion_request, parse_choice, probe_request
from rolledger.workers.engines.vllm_facts import parse_version, server_facts
from rolledger.workers.engines.vllm_http import VllmHttp
from rolledger.workers.runtime.netguard import check_engine_address


@dataclass
class _RankState:
    policy_version: int = 0
    cache_generation: int = 0
    graph_generation: int = 0
    paused: bool = False
    pause_mode: PauseMode | None = None  # how the engine was paused (None while it generates)
    in_flight: int = 0  # completion requests counted before they were sent, whose answer has not come back yet
    sleep: SleepState = field(default_factory=SleepState)  # per tag (workers/engines/sleep_state)
    staged_version: int | None = None
    weights_digest: str = ""
    stats: EngineStats = field(default_factory=EngineStats)


def kv_cache_tokens(metrics: str) -> int | None:
    """num_gpu_blocks x block_size from the labels of `vllm:cache_config_info` in a /metrics text, or None."""
    for line in metrics.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
            if blocks.isdigit() and size.isdigit():
                return int(blocks) * int(size)
    return None


_STRAGGLER_POLL_S = 0.1  # how often a pause asks the server again while a request of ours is unanswered


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


class VllmEngine:
    """One rank: a vLLM server reached over HTTP. See the module docstring for what each method sends."""

    def __init__(
        self,
        base_url: str,
        *,
        rank: int,
        model_name: str,
        allow_remote: bool = False,
        timeout_s: float = 60.0,
        reset_deadline_s: float = 10.0,
    ) -> None:
        check_engine_address(base_url, allow_remote)
        self.base_url = base_url.rstrip("/")
        self.rank = rank
        self.model_name = model_name
        self.timeout_s = timeout_s
        self.reset_deadline_s = reset_deadline_s
        self.http = VllmHttp(self.base_url, timeout_s)
        self._st = _RankState()
        self._stats_lock = threading.Lock()  # generate runs in several rollout slots at once
        self._resumed = threading.Condition()  # guards paused/pause_mode; notified by resume() (parked samples wait)
        self._kv_tokens: int | None = None  # kv_cache_tokens, once read (0: the server does not say)
        self._tmp_staging: tempfile.TemporaryDirectory[str] | None = None
        self.facts = server_facts(self.http)
        # why this server must not sleep at level 2 ('' when it may): a speculative draft, an FP8 KV cache
        self.level_2_refused = level_2_refusal(
            speculative=self.facts.speculative, kv_cache_dtype=self.facts.kv_cache_dtype
        )
        label = str(self.http.get("/weight_info").get("weight_version", "default"))
        self._st.policy_version = parse_version(label)
        if label == "default":  # a fresh server serves its start-up checkpoint: policy version 0, say so
            self.http.post("/update_weight_version", json={"new_version": "0"})
        self._st.weights_digest = self.weights_digest()

    # -- Engine protocol: identity ------------------------------------------------------------------------------

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            name="vllm",
            sleep_levels=((1,) if self.level_2_refused else (1, 2)) if self.facts.sleep_mode else (),
            prefix_cache=self.facts.prefix_caching,
            logprob_mode="processed" if self.facts.logprob_mode == "processed" else "raw",
            interruptible=True,
            streams_samples=True,
        )

    @property
    def policy_version(self) -> int:
        return self._st.policy_version

    @property
    def stats(self) -> EngineStats:
        return self._st.stats

    # -- generation ---------------------------------------------------------------------------------------------

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

    def _abort_stragglers(self) -> None:
        """After the server's pause aborted what it ran: wait until every request of ours has come back. A request
        that passed generate's check just before this pause can reach the server after it; vLLM queues such a
        request while paused (PAUSED_NEW) and would run it at resume, on the new weights under the old version's
        stamp, and until then the drain waits for it. Each round asks the server to pause with "abort" again, which
        aborts whatever it holds, queued or running; a request still on its way is caught by a later round. With a
        deadline: the engine's timeout."""
        cut_until_answered(
            self._resumed,
            lambda: self._st.in_flight,
            lambda: self._server_pause("abort"),
            poll_s=_STRAGGLER_POLL_S,
            timeout_s=self.timeout_s,
            what=f"the vLLM server of rank {self.rank}",
        )

    # -- pause / sleep ------------------------------------------------------------------------------------------

    def pause(self, mode: PauseMode) -> None:
        """Stop generation: "wait" lets what runs finish, "abort" cuts it short, "keep" parks it (interruptible: the
        server aborts what it runs, and each cut sample waits in `generate` to continue after `resume`). The engine
        says it is paused before it asks the server, so a generation cut by this pause always finds itself parked."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be abort|wait|keep, got {mode!r}")
        with self._resumed:
            was = (self._st.paused, self._st.pause_mode)
            self._st.paused, self._st.pause_mode = True, mode
        try:
            self._server_pause("abort" if mode == "keep" else mode)
        except BaseException:
            with self._resumed:
                self._st.paused, self._st.pause_mode = was
            raise
        if mode != "wait":  # "wait" lets what runs finish; a rank asks for it once none of its groups runs
            self._abort_stragglers()

    def resume(self) -> None:
        self._server_resume()
        with self._resumed:
            self._st.paused, self._st.pause_mode = False, None
            self._resumed.notify_all()

    def _server_pause(self, mode: str) -> None:
        body = self.http.post("/pause", params={"mode": mode})
        if body.get("status") != "paused":
            raise EngineError(f"rank {self.rank}: vLLM /pause answered {body!r}")

    def _server_resume(self) -> None:
        body = self.http.post("/resume")
        if body.get("status") != "resumed":
            raise EngineError(f"rank {self.rank}: vLLM /resume answered {body!r}")

    @property
    def is_paused(self) -> bool:
        """The server's own answer (GET /is_paused), not just what this engine asked for."""
        paused = bool(self.http.get("/is_paused").get("is_paused"))
        self._st.paused = paused
        return paused

    def _sleep_unavailable(self, what: str) -> EngineError:
        return EngineError(
            f"rank {self.rank}: {what} is unavailable: the vLLM server at {self.base_url} runs without sleep mode "
            "(vLLM refuses --enable-sleep-mode on CPU); capabilities.sleep_levels is ()"
        )

    def sleep(self, level: int) -> SleepReport:
        if not self.facts.sleep_mode:
            raise self._sleep_unavailable("sleep")
        if level == 2 and self.level_2_refused:
            raise EngineError(f"rank {self.rank}: sleep(2) refused: {self.level_2_refused}; sleep at level 1")
        with self._resumed:
            after = self._st.sleep.slept(level, self.rank)  # ValueError / IllegalEngineOrder before the server
        self.http.post("/sleep", params={"level": level, "mode": "wait"})
        with self._resumed:
            self._st.sleep = after
        # vLLM does not report freed bytes over HTTP; unverified here (a GPU rank agent measures nvidia-smi)
        return SleepReport(level=level, bytes_before=0, bytes_after=0, verified=False)

    def wake(self, tags: Sequence[WakeTag]) -> WakeReport:
        if not self.facts.sleep_mode:
            raise self._sleep_unavailable("wake")
        with self._resumed:
            after, woken = self._st.sleep.woken(tags, self.rank)
        if woken:  # only tags that sleep: asked for one that does not, vLLM's executor wakes nothing at all
            body = self.http.post("/wake_up", params=[("tags", t) for t in woken])
            want = "sleeping" if after.asleep else "awake"
            if body.get("status", want) != want:  # 0.31 answers an empty 200
                raise EngineError(f"rank {self.rank}: vLLM /wake_up?tags={','.join(woken)} answered {body!r}")
        with self._resumed:
            self._st.sleep = after
            if woken and not after.asleep:
                self._st.paused = False  # a full wake resumes the scheduler in vLLM (a partial one keeps it paused)
        return WakeReport(tags=woken, bytes_restored=0)

    @property
    def asleep_level(self) -> int:
        return self._st.sleep.asleep_level

    @property
    def sleep_state(self) -> SleepState:
        return self._st.sleep

    def kv_cache_tokens(self) -> int | None:
        """The server's KV cache in tokens: `num_gpu_blocks` x `block_size` of its `vllm:cache_config_info` metric
        (vLLM names its CPU blocks so too), read once; None where the server does not say."""
        if self._kv_tokens is None:
            self._kv_tokens = kv_cache_tokens(self.http.request("GET", "/metrics").text) or 0
        return self._kv_tokens or None

    # -- weights ------------------------------------------------------------------------------------------------

    def _answers(self, results: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
        bad = [r for r in results if not r.get("ok")]
        if bad:
            r = bad[0]
            tensor = r.get("tensor")
            reason = f"worker {r.get('rank')} {what}: {r.get('error')}"
            if tensor and tensor != "*" and what == "prepare":
                raise WeightValidationError(
                    str(tensor), f"{r.get('reason')} (rank {self.rank}, vLLM worker {r.get('rank')}, prepare)"
                )
            raise EngineError(f"rank {self.rank} {reason}")
        return results

    def _one_digest(self, results: list[dict[str, Any]], key: str) -> str:
        digests = {str(r.get(key, "")) for r in results}
        if len(digests) != 1:
            raise EngineError(f"rank {self.rank}: vLLM workers disagree on {key}: {sorted(digests)}")
        return digests.pop()

    def live_tensor_specs(self) -> Mapping[str, TensorSpec]:
        specs = self._answers(self.http.rpc("rolledger_specs"), "specs")[0]["specs"]
        return {name: TensorSpec(shape=tuple(shape), dtype=str(dtype)) for name, (shape, dtype) in specs.items()}

    @property
    def cache_generation(self) -> int:
        return self._st.cache_generation

    @property
    def graph_generation(self) -> int:
        return self._st.graph_generation

    def prepare(self, version: int, uri: str, manifest: WeightManifest) -> str:
        """The Engine prepare path: the server's own workers read and verify the staged files (prepare_from_uri)."""
        return self.prepare_from_uri(version, uri, manifest)

    def prepare_from_uri(self, version: int, uri: str, manifest: Any) -> str:
        """Every vLLM worker reads and validates the staged update at `uri`; returns the staged weights digest.

        `manifest`: a schemas.weights.WeightManifest, its JSON string, or a dict. Raises WeightValidationError naming
        the tensor (or EngineError); the live weights keep serving either way.
        """
        self._st.sleep.check_weights_awake(f"prepare v{version}", self.rank)
        if hasattr(manifest, "model_dump_json"):
            manifest_json = manifest.model_dump_json()
        elif isinstance(manifest, str):
            manifest_json = manifest
        else:
            manifest_json = json.dumps(manifest)
        self._st.staged_version = None
        results = self._answers(self.http.rpc("rolledger_prepare", version, uri, manifest_json), "prepare")
        self._st.staged_version = version
        return self._one_digest(results, "staged_digest")

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> str:
        """Write `tensors` to a private temporary staging directory, then prepare_from_uri (local servers only)."""
        from rolledger.workers.weights.staging_store import DirectoryStagingStore

        self._st.sleep.check_weights_awake(f"stage v{version}", self.rank)
        if self._tmp_staging is None:
            self._tmp_staging = tempfile.TemporaryDirectory(prefix=f"rolledger-vllm-rank{self.rank}-")
        store = DirectoryStagingStore(self._tmp_staging.name)
        if version in store.versions():
            import shutil

            shutil.rmtree(store.version_dir(version))
        staged = store.stage(version, self._st.policy_version, tensors)
        return self.prepare_from_uri(version, staged.uri, staged.manifest)

    def commit_weights(self, version: int) -> CommitReport:
        self._st.sleep.check_weights_awake(f"commit v{version}", self.rank)
        if self._st.staged_version != version:
            raise IllegalEngineOrder(
                f"rank {self.rank}: commit of version {version} but staged is {self._st.staged_version}"
            )
        self._st.staged_version = None
        results = self._answers(self.http.rpc("rolledger_commit", version), "commit")
        digest = self._one_digest(results, "digest")
        self._publish(version, digest)
        return CommitReport(
            policy_version=version,
            weights_digest=digest,
            cache_generation=self._st.cache_generation,
            graph_generation=self._st.graph_generation,
            graphs_invalidated=False,  # same shapes, reloaded in place: vLLM keeps its graphs
        )

    def rollback_weights(self) -> CommitReport:
        """Back to the version before the last commit, on every worker; version label and prefix cache follow."""
        self._st.sleep.check_weights_awake("rollback", self.rank)
        results = self._answers(self.http.rpc("rolledger_rollback"), "rollback")
        digest = self._one_digest(results, "digest")
        version = int(results[0]["version"])
        self._publish(version, digest)
        return CommitReport(version, digest, self._st.cache_generation, self._st.graph_generation, False)

    def _publish(self, version: int, digest: str) -> None:
        """After the weights changed: version label (checked), prefix cache reset, local state."""
        with self._resumed:
            self._st.sleep = self._st.sleep.committed()
        self._st.weights_digest = digest
        self._st.policy_version = version
        self.http.post("/update_weight_version", json={"new_version": str(version)})
        got = self.http.get("/weight_info").get("weight_version")
        if got != str(version):
            raise EngineError(f"rank {self.rank}: /weight_info says {got!r} after setting version {version}")
        self.reset_prefix_cache()

    def discard_weights(self) -> None:
        self._answers(self.http.rpc("rolledger_discard"), "discard")
        self._st.staged_version = None

    def inject(self, spec: str) -> None:
        """Arm a one-shot fault in every worker (tests/demos): see workers.weights.vllm_extension.FAULTS."""
        self._answers(self.http.rpc("rolledger_inject", spec), "inject")

    def reset_prefix_cache(self) -> int:
        """POST /reset_prefix_cache until it says success (it answers 200 success:false while blocks are held)."""
        deadline = time.monotonic() + self.reset_deadline_s
        delay = 0.01
        while True:
            body = self.http.post("/reset_prefix_cache")
            if body.get("success") is True:
                break
            if time.monotonic() + delay > deadline:
                raise EngineError(
                    f"rank {self.rank}: /reset_prefix_cache still answers success:false after "
                    f"{self.reset_deadline_s}s (requests still hold cache blocks; pause first)"
                )
            time.sleep(delay)  # retry backoff, bounded by the deadline above
            delay = min(delay * 2, 0.5)
        self._st.cache_generation += 1
        return self._st.cache_generation

    def weights_digest(self) -> str:
        return self._one_digest(self._answers(self.http.rpc("rolledger_digest"), "digest"), "digest")

    def live_digest(self) -> str:
        """Digest of what actually serves (live parameters and repacked kernels); comparable within one server."""
        return self._one_digest(self._answers(self.http.rpc("rolledger_live_digest"), "live digest"), "live_digest")

    def health(self) -> HealthReport:
        """Greedy probe through /v1/completions. A rank probes right after its commit, while it is still paused for
        the update (it resumes on PolicyPublished); a paused vLLM scheduler would never run the probe, so the server
        is resumed for the probe alone and paused again ("wait": nothing else is in flight, the rank's rollout is
        gated until PolicyPublished). Not ok while a tag sleeps (the order wakes kv_cache before the probe)."""
        if not self._st.sleep.serving:
            return HealthReport(ok=False, detail=f"rank {self.rank}: not serving ({self._st.sleep.describe()})")
        if not self.is_paused:
            return self._probe()
        self._server_resume()  # the server only: generations parked by pause("keep") stay parked
        try:
            return self._probe()
        finally:
            self._server_pause("wait")

    def _probe(self) -> HealthReport:
        try:
            self.http.request("GET", "/health")
            body = self.http.post("/v1/completions", json=probe_request(self.model_name))
            sample = parse_choice(body["choices"][0], self.rank)
        except (EngineError, KeyError, IndexError) as e:
            return HealthReport(ok=False, detail=f"rank {self.rank}: {e}")
        if not all(math.isfinite(x) for x in sample.logprobs):
            return HealthReport(ok=False, detail=f"rank {self.rank}: probe logprobs not finite: {sample.logprobs}")
        h = xxhash.xxh3_128()
        h.update(json.dumps([sample.token_ids, [round(x, 3) for x in sample.logprobs]]).encode())
        return HealthReport(ok=True, detail=f"rank {self.rank}: probe ok", probe_digest=h.hexdigest())

    def close(self) -> None:
        self.http.close()
        if self._tmp_staging is not None:
            self._tmp_staging.cleanup()
            self._tmp_staging = None
