"""The vLLM engine: one inference rank, a vLLM server driven over HTTP (workers.engines.vllm_http). This module
connects to the server and owns identity, pause/resume, sleep/wake and the health probe; generation is
workers.engines.vllm_generate's, the weight update workers.engines.vllm_update's (both parts of `VllmEngine`).

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

import re
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import replace

from rolledger.workers.engines.protocol import (
    EngineCapabilities,
    EngineError,
    EngineStats,
    HealthReport,
    PauseMode,
    SleepReport,
    WakeReport,
    WakeTag,
    cut_until_answered,
)
from rolledger.workers.engines.server_engine import probe_report, refuse_level_2
from rolledger.workers.engines.sleep_state import SleepState, level_2_refusal
from rolledger.workers.engines.spec_counters import acceptance
from rolledger.workers.engines.vllm_completions import parse_choice, probe_request
from rolledger.workers.engines.vllm_facts import parse_version, server_facts
from rolledger.workers.engines.vllm_generate import VllmGeneration
from rolledger.workers.engines.vllm_http import VllmHttp
from rolledger.workers.engines.vllm_state import VllmRankState
from rolledger.workers.engines.vllm_update import VllmUpdate
from rolledger.workers.runtime.netguard import check_engine_address


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


class VllmEngine(VllmGeneration, VllmUpdate):
    """One rank: a vLLM server reached over HTTP. See the module docstring for what each method sends; generation is
    VllmGeneration's (vllm_generate.py), the weight update VllmUpdate's (vllm_update.py)."""

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
        self._st = VllmRankState()
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

    @property
    def cache_generation(self) -> int:
        return self._st.cache_generation

    @property
    def graph_generation(self) -> int:
        return self._st.graph_generation

    # -- pause / sleep ------------------------------------------------------------------------------------------

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
        refuse_level_2(self.rank, level, self.level_2_refused)
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
        report = probe_report(self.rank, sample)
        if not self.facts.speculative:
            return report
        now = self._spec_counters()
        rate, self._st.spec_mark = acceptance(self._st.spec_mark, now), now
        return replace(report, spec_acceptance_rate=rate, spec_acceptance_before=self._st.spec_before)

    def close(self) -> None:
        self.http.close()
        if self._tmp_staging is not None:
            self._tmp_staging.cleanup()
            self._tmp_staging = None
