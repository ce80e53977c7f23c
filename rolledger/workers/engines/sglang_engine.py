"""The SGLang engine: one inference rank, an SGLang server driven over its HTTP routes. This module connects to the
server and owns generation, pause/resume, sleep/wake, the prefix cache and the health probe; the weight update is
workers.engines.sglang_update's (a part of `SglangEngine`).

`SglangEngine` implements workers.engines.protocol.Engine against `python -m sglang.launch_server` (workers.engines.sglang_server
starts one; on CPU it runs with a stand-in for the CUDA-only `sgl_kernel`, see that module):

- generate: `POST /generate` with the prompt as `input_ids`, `sampling_params.n`, `return_logprob`. Every sample's
  `meta_info.weight_version` must be the rank's policy version (else EngineError: a sample of other weights is never
  returned). Logprobs are raw (the launcher sets SGLANG_RETURN_ORIGINAL_LOGPROB=1; a server started by hand must set
  it too, or the trainer's logprob-agreement gate halts the run). A rank's rollout slots (`rank_slots`) call it at
  once, each its own request on the shared connection pool (workers.engines.vllm_http), counted in flight.
- pause/resume: `/pause_generation` (`abort` -> abort, `keep` -> in_place) and `/continue_generation`; `wait` waits
  (with a deadline) for this engine's own requests to end, then pauses in place; `abort` returns once every request of
  this engine has come back, cut (one that reached the server after the pause is let in and cut again: SGLang holds
  it at its door, out of an abort's reach). While paused `generate` is refused.
- weights, as a transaction. prepare: read the staged update through the verified path (every checksum; a corrupt
  file names the tensor), check names/shapes/dtypes against the serving model (workers.engines.torch_weights), and
  write it as a checkpoint directory SGLang can load (workers.engines.sglang_weights); the live weights keep serving.
  commit: `/update_weights_from_disk` with that directory, the version label and `flush_cache`; then the live
  weights are *read back*: `/weights_checker` checksums every live parameter, which must equal what the update's
  tensors give (a mismatch names the tensors). A failed or unverified commit is rolled back by loading the previous
  directory again and verifying that, because SGLang 0.5.23's own rollback after a failed load re-reads the *new*
  path (it sets model_config.model_path before loading). `rollback_weights` goes back one version the same way.
- weights_digest: the digest of the version whose checksums the server reports now (measured, not remembered: a
  server whose weights match no version this engine loaded is an EngineError).
- reset_prefix_cache: `/flush_cache`, retried until it succeeds (it answers 400 while requests run), with a deadline.
- sleep/wake: `/release_memory_occupation` and `/resume_memory_occupation` with tags, only where the server runs on a
  GPU with `--enable-memory-saver`; elsewhere they raise EngineError saying so and `capabilities.sleep_levels == ()`
  (on CPU SGLang's release crashes its scheduler). The sleep state is kept per tag (workers.engines.sleep_state):
  sleep releases `weights` and `kv_cache`, `wake(["weights"])` lets an update be prepared and committed while the
  KV cache still sleeps, and weights are never sent while they sleep.

The rank agent (this process) and the server must share a filesystem: the server reads the prepared directory
(`staging_dir`, by default a private temporary directory) and, at connect, this engine reads the serving checkpoint
(`model_dir`, by default the server's own `model_path`).
"""

from __future__ import annotations

import math
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file

from rolledger.schemas.config import SamplingParams
from rolledger.workers.engines.protocol import (
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
    cut_until_answered,
    refuse_unless_serving,
)
from rolledger.workers.engines.server_engine import probe_report, refuse_level_2
from rolledger.workers.engines.sglang_state import SglangRankState
from rolledger.workers.engines.sglang_update import SglangUpdate
from rolledger.workers.engines.sglang_weights import differing
from rolledger.workers.engines.sleep_state import TAGS, SleepState, level_2_refusal
from rolledger.workers.engines.vllm_completions import PROBE_PROMPT
from rolledger.workers.engines.vllm_http import JsonHttp
from rolledger.workers.runtime.netguard import check_engine_address
from rolledger.workers.weights.tensors import dtype_name

_HELD_POLL_S = 0.2  # how long a pause with abort waits for its requests before it lets held ones in to cut them
_FINISH: dict[str, Literal["stop", "length", "abort"]] = {"stop": "stop", "length": "length", "abort": "abort"}
_PAUSE_MODE = {"abort": "abort", "keep": "in_place", "wait": "in_place"}


class SglangHttp(JsonHttp):
    server = "SGLang"


def _sample(item: Mapping[str, Any], rank: int, version: int) -> SampleOutput:
    meta = item.get("meta_info") or {}
    ids = item.get("output_ids")
    lps = meta.get("output_token_logprobs")
    if ids is None or lps is None:
        raise EngineError(f"rank {rank}: SGLang /generate answer lacks output_ids/output_token_logprobs")
    if len(lps) != len(ids):
        raise EngineError(f"rank {rank}: {len(ids)} tokens but {len(lps)} logprobs from SGLang")
    served = str(meta.get("weight_version"))
    if served != str(version):
        raise EngineError(f"rank {rank}: SGLang generated with weight_version {served!r}, the rank is on v{version}")
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason not in _FINISH:
        raise EngineError(f"rank {rank}: unknown finish_reason {reason!r} from SGLang")
    return SampleOutput(
        token_ids=[int(t) for t in ids],
        logprobs=[float(x[0]) if x[0] is not None else -math.inf for x in lps],
        finish_reason=_FINISH[reason],
    )


class SglangEngine(SglangUpdate):
    """One rank: an SGLang server reached over HTTP. See the module docstring for what each method sends."""

    def __init__(
        self,
        base_url: str,
        *,
        rank: int,
        model_dir: str | Path | None = None,
        staging_dir: str | Path | None = None,
        allow_remote: bool = False,
        timeout_s: float = 60.0,
        pause_timeout_s: float = 60.0,
        reset_deadline_s: float = 10.0,
    ) -> None:
        check_engine_address(base_url, allow_remote)
        self.base_url = base_url.rstrip("/")
        self.rank = rank
        self.pause_timeout_s = pause_timeout_s
        self.reset_deadline_s = reset_deadline_s
        self.http = SglangHttp(self.base_url, timeout_s)
        info = self.http.get("/server_info")
        self.server_version = str(info.get("version", "unknown"))
        self.device = str(info.get("device", "unknown"))
        self.memory_saver = bool(info.get("enable_memory_saver", False))
        self.prefix_caching = not bool(info.get("disable_radix_cache", False))
        # why this server must not sleep at level 2 ('' when it may): a speculative draft, an FP8 KV cache
        self.level_2_refused = level_2_refusal(
            speculative=str(info.get("speculative_algorithm") or ""),
            kv_cache_dtype=str(info.get("kv_cache_dtype") or "auto"),
        )
        total = info.get("max_total_num_tokens")  # the KV pool in tokens, where the server says
        self._kv_tokens = int(total) if isinstance(total, int) and total > 0 else None
        self.model_dir = Path(model_dir if model_dir is not None else str(info.get("model_path", ""))).absolute()
        self.hf_config = _read_config(self.model_dir)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if staging_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=f"rolledger-sglang-rank{rank}-")
            staging_dir = self._tmp.name
        self.staging_dir = Path(staging_dir).absolute()
        self._cond = threading.Condition()
        label = str(self.http.get("/model_info").get("weight_version", "default"))
        version = 0 if label == "default" else _parse_version(label)
        tensors = _load_checkpoint(self.model_dir)
        self._st = SglangRankState(live=self._loaded(version, self.model_dir, tensors))
        bad = differing(self._st.live.checksums, self.live_checksums())
        if bad:
            param, names, what = bad[0]
            raise EngineError(
                f"rank {rank}: the SGLang server at {self.base_url} does not serve the checkpoint at {self.model_dir} "
                f"as rolledger can verify it ({param} [{', '.join(names)}]: {what}); start it from that directory, "
                "unquantized"
            )
        if label == "default":  # a fresh server serves its start-up checkpoint: policy version 0, say so
            self.http.post("/update_weight_version", json={"new_version": "0", "abort_all_requests": False})
        self._specs = {n: TensorSpec(tuple(t.shape), dtype_name(t.dtype)) for n, t in tensors.items()}

    # -- Engine protocol: identity ------------------------------------------------------------------------------

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            name="sglang",
            sleep_levels=((1,) if self.level_2_refused else (1, 2)) if self._can_sleep else (),
            prefix_cache=self.prefix_caching,
            logprob_mode="raw",
        )

    @property
    def _can_sleep(self) -> bool:
        return self.device != "cpu" and self.memory_saver

    @property
    def policy_version(self) -> int:
        return self._st.live.version

    @property
    def stats(self) -> EngineStats:
        return self._st.stats

    @property
    def cache_generation(self) -> int:
        return self._st.cache_generation

    @property
    def graph_generation(self) -> int:
        return 0  # same shapes are loaded in place; SGLang keeps its graphs

    # -- generation ---------------------------------------------------------------------------------------------

    def generate_request(self, prompt_token_ids: Sequence[int], n: int, sampling: SamplingParams) -> dict[str, Any]:
        """The /generate body of a group (public so benchmarks can send the same request directly)."""
        params: dict[str, Any] = {
            "n": n,
            "max_new_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        }
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        return {"input_ids": [int(t) for t in prompt_token_ids], "sampling_params": params, "return_logprob": True}

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        n: int,
        sampling: SamplingParams,
        *,
        should_cancel: Callable[[int], bool] | None = None,
        expect_version: int | None = None,
    ) -> GroupOutput:
        """N samples in one request (SGLang's radix cache prefills the shared prompt once).

        `should_cancel` is polled before the request only (a non-streaming request is not cancelled per sample);
        samples cancelled up front are returned empty with finish_reason "abort".
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if sampling.logprob_mode != "raw":
            raise EngineError(
                f"rank {self.rank}: sampling.logprob_mode={sampling.logprob_mode!r} but the SGLang engine reports raw "
                "logprobs (SGLANG_RETURN_ORIGINAL_LOGPROB=1)"
            )
        with self._cond:
            self._st.sleep.check_serving("generate", self.rank)
            if self._st.paused:
                raise IllegalEngineOrder(f"rank {self.rank}: generate while paused")
            refuse_unless_serving(expect_version, self._st.live.version, self.rank)
            self._st.inflight += 1
            live = self._st.live
            cache_generation = self._st.cache_generation
        try:
            cancelled = [i for i in range(n) if should_cancel is not None and should_cancel(i)]
            live_n = n - len(cancelled)
            samples: list[SampleOutput] = []
            cached = 0
            if live_n:
                resp = self.http.request(
                    "POST", "/generate", json=self.generate_request(prompt_token_ids, live_n, sampling)
                )
                body = resp.json()
                items = body if isinstance(body, list) else [body]
                if len(items) != live_n:
                    raise EngineError(f"rank {self.rank}: asked SGLang for {live_n} samples, got {len(items)}")
                samples = [_sample(it, self.rank, live.version) for it in items]
                cached = max(int((it.get("meta_info") or {}).get("cached_tokens") or 0) for it in items)
            samples += [SampleOutput(token_ids=[], logprobs=[], finish_reason="abort") for _ in cancelled]
        finally:
            with self._cond:
                self._st.inflight -= 1
                self._cond.notify_all()
        cached = min(cached, len(prompt_token_ids))
        with self._cond:  # generate runs in several rollout slots at once
            st = self._st.stats
            st.groups += 1
            st.generated_tokens += sum(len(s.token_ids) for s in samples)
            st.prefill_tokens_computed += len(prompt_token_ids) - cached
            st.prefill_tokens_saved += cached
        return GroupOutput(
            samples=samples,
            policy_version=live.version,
            weights_digest=live.digest,
            cache_generation=cache_generation,
            graph_generation=0,
            prefill_tokens_computed=len(prompt_token_ids) - cached,
            prefill_tokens_saved=cached,
        )

    # -- pause / sleep ------------------------------------------------------------------------------------------

    def pause(self, mode: PauseMode) -> None:
        if mode not in _PAUSE_MODE:
            raise ValueError(f"pause mode must be abort|wait|keep, got {mode!r}")
        with self._cond:
            self._st.paused = True  # no new generate from here on
            if mode == "wait":
                deadline = time.monotonic() + self.pause_timeout_s
                while self._st.inflight:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise EngineError(
                            f"rank {self.rank}: pause('wait') timed out with {self._st.inflight} request(s) in flight"
                        )
                    self._cond.wait(left)
        self._server_pause(_PAUSE_MODE[mode])
        if mode == "abort":
            self._abort_held()

    def _server_pause(self, mode: str) -> None:
        body = self.http.post("/pause_generation", json={"mode": mode})
        if body.get("status") != "ok":
            raise EngineError(f"rank {self.rank}: SGLang /pause_generation answered {body!r}")

    def _abort_held(self) -> None:
        """After the server's abort pause: wait until every request of ours has come back. A request that passed
        generate's check just before this pause can reach the server after it; SGLang holds such a request at its
        door while paused, before it enters the table of requests an abort reaches, and would run it at the next
        continue, so a drain waiting for it would wait until its deadline. Each round lets the held requests in
        (`/continue_generation`; this engine already refuses new ones) and pauses with abort again, which cuts them
        where they are (0 tokens, or the few generated in between, on the serving version); one still on its way
        is caught by a later round. With a deadline: `pause_timeout_s`."""

        def let_in_and_cut() -> None:
            body = self.http.post("/continue_generation", json={})
            if body.get("status") != "ok":
                raise EngineError(f"rank {self.rank}: SGLang /continue_generation answered {body!r}")
            self._server_pause("abort")

        cut_until_answered(
            self._cond,
            lambda: self._st.inflight,
            let_in_and_cut,
            poll_s=_HELD_POLL_S,
            timeout_s=self.pause_timeout_s,
            what=f"the SGLang server of rank {self.rank} with abort",
        )

    def resume(self) -> None:
        body = self.http.post("/continue_generation", json={})
        if body.get("status") != "ok":
            raise EngineError(f"rank {self.rank}: SGLang /continue_generation answered {body!r}")
        with self._cond:
            self._st.paused = False

    @property
    def is_paused(self) -> bool:
        with self._cond:
            return self._st.paused

    def _sleep_unavailable(self, what: str) -> EngineError:
        return EngineError(
            f"rank {self.rank}: {what} is unavailable: the SGLang server at {self.base_url} runs on {self.device}"
            f"{'' if self.memory_saver else ' without --enable-memory-saver'} (SGLang releases memory on a GPU only); "
            "capabilities.sleep_levels is ()"
        )

    def sleep(self, level: int) -> SleepReport:
        if not self._can_sleep:
            raise self._sleep_unavailable("sleep")
        refuse_level_2(self.rank, level, self.level_2_refused)
        with self._cond:
            after = self._st.sleep.slept(level, self.rank)  # ValueError / IllegalEngineOrder before the server
            if self._st.inflight:
                raise IllegalEngineOrder(f"rank {self.rank}: sleep with {self._st.inflight} request(s) in flight")
            if self._st.staged is not None:
                raise IllegalEngineOrder(f"rank {self.rank}: sleep with v{self._st.staged.version} staged")
        self.http.post("/release_memory_occupation", json={"tags": list(TAGS)})  # cuda_graph stays resident
        with self._cond:
            self._st.sleep = after
        return SleepReport(level=level, bytes_before=0, bytes_after=0, verified=False)

    def wake(self, tags: Sequence[WakeTag]) -> WakeReport:
        if not self._can_sleep:
            raise self._sleep_unavailable("wake")
        with self._cond:
            after, woken = self._st.sleep.woken(tags, self.rank)
        if woken:
            self.http.post("/resume_memory_occupation", json={"tags": list(woken)})
        with self._cond:
            self._st.sleep = after
        return WakeReport(tags=woken, bytes_restored=0)

    @property
    def asleep_level(self) -> int:
        return self._st.sleep.asleep_level

    @property
    def sleep_state(self) -> SleepState:
        return self._st.sleep

    def kv_cache_tokens(self) -> int | None:
        """The server's KV pool in tokens (`max_total_num_tokens` of /server_info, read at connect), or None."""
        return self._kv_tokens

    # -- the prefix cache and health ------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        """POST /flush_cache until it succeeds (it answers 400 while requests run), within reset_deadline_s."""
        deadline = time.monotonic() + self.reset_deadline_s
        delay = 0.01
        while True:
            try:
                self.http.request("POST", "/flush_cache")
                break
            except EngineError as e:
                if time.monotonic() + delay > deadline:
                    raise EngineError(
                        f"rank {self.rank}: /flush_cache still refused after {self.reset_deadline_s}s ({e}); pause first"
                    ) from e
            time.sleep(delay)  # retry backoff, bounded by the deadline above
            delay = min(delay * 2, 0.5)
        with self._cond:
            self._st.cache_generation += 1
            return self._st.cache_generation

    def health(self) -> HealthReport:
        """Greedy 4-token probe through /generate. A rank probes after its commit while still paused; the server is
        continued for the probe alone and paused again. Not ok while a tag sleeps."""
        if not self._st.sleep.serving:
            return HealthReport(ok=False, detail=f"rank {self.rank}: not serving ({self._st.sleep.describe()})")
        paused = self.is_paused
        if paused:
            self.http.post("/continue_generation", json={})
        try:
            return self._probe()
        finally:
            if paused:
                self.http.post("/pause_generation", json={"mode": "in_place"})

    def _probe(self) -> HealthReport:
        body = {
            "input_ids": list(PROBE_PROMPT),
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True,
        }
        try:
            item = self.http.request("POST", "/generate", json=body).json()
            sample = _sample(item, self.rank, self._st.live.version)
        except (EngineError, KeyError, IndexError, ValueError) as e:
            return HealthReport(ok=False, detail=f"rank {self.rank}: {e}")
        return probe_report(self.rank, sample)

    def close(self) -> None:
        self.http.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _parse_version(label: str) -> int:
    try:
        return int(label)
    except ValueError as e:
        raise EngineError(f"SGLang weight_version {label!r} is not a rolledger policy version") from e


def _read_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    if not (model_dir / "config.json").is_file():
        raise EngineError(f"no checkpoint (config.json) in {model_dir}: pass the serving model's directory")
    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def _load_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors
