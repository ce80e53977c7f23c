"""The built-in torch engine: one inference rank running a Hugging Face causal LM in-process.

This module is one concept that reads better whole (about 580 lines): the rules below are one state machine over two
locks. Every public method checks and changes the same flags under them (a parked generation releases the model
lock, sleep and commit take both), so cutting it further would spread one locking invariant over several modules;
the work each rule guards already lives in the modules named below.

`TorchEngine` composes, from the modules beside it in workers/engines/: KV-cache generation of groups and sampling
(torch_decode), one group per call or, with `batch_groups`, the groups of concurrent calls in one decode batch run by
the engine's decode thread (torch_batch; `max_batch_groups` bounds the groups one step decodes, the rest wait for
room), with a real prefix cache (torch_prefix_cache), sleep/wake with measured (accounted) memory
(torch_memory), and the two-step weight update: stage into an inactive buffer, commit by copying into the live
parameters (torch_weights). What this module owns is the order those may happen in: pause/resume and parking, and
the rules below, over two locks (the model lock around every use of the model, its parameters and the prefix cache;
a condition over the flags).

Rules this engine enforces (IllegalEngineOrder otherwise):
- generate: refused while paused, while any sleep tag is still asleep, and while the live weights are not valid
  (after a level-2 sleep the weights are reallocated by wake(["weights"]) but hold garbage until a commit).
- pause(mode): "abort" ends running generations at their next decode step (unfinished samples -> "abort");
  "wait" lets them finish; "keep" parks them at their next decode step (releasing the model lock) until resume().
  pause returns once in-flight work is quiescent (finished, or parked for "keep"), within a deadline. In flight
  counts every generate called (a rank's rollout slots call it at once; they take the model lock one at a time, so
  one still waiting for it is in flight too: it runs, or parks at its first step, before pause returns). With
  batch_groups the decode thread parks once for its whole batch and counts every group it holds as parked.
  This engine is not interruptible: a parked generation that finds a different policy version (or the engine asleep)
  when it resumes ends its unfinished samples with "abort" instead of mixing versions.
- sleep(level): refused with generations in flight, with staged weights pending, or when already asleep.
  Level 1 offloads the weights to a host copy (on a CPU device the host copy *is* the old storage: ownership moves,
  no bytes are copied) and drops the prefix cache; level 2 drops the weights entirely. Both replace every live
  parameter's storage with an empty tensor, so accounted bytes (live parameter storage + prefix-cache KV) go to 0.
- wake(tags): "weights" must be woken before (or in the same call as) "kv_cache". After level 1 the host copy is
  restored; after level 2 the parameters are reallocated uninitialised and must be filled by stage + commit.
- stage/commit: allowed whenever the "weights" tag is awake (never while the weights are asleep), even if
  "kv_cache" still sleeps — that is how new weights arrive after a level-2 sleep. sleep() is refused while a
  staged buffer is pending; commit needs the staged version.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch

from rolledger.schemas.config import SamplingParams
from rolledger.schemas.weights import WeightManifest
from rolledger.workers.engines import torch_memory, torch_weights
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
from rolledger.workers.engines.sleep_state import TAGS, SleepState
from rolledger.workers.engines.torch_batch import BatchRequest, GroupBatcher, wait_for
from rolledger.workers.engines.torch_decode import Decoded, KVDecoder, validate_request
from rolledger.workers.engines.torch_prefix_cache import PrefixCache
from rolledger.workers.policy.policy_model import policy_state
from rolledger.workers.weights.tensors import dtype_name, state_digest
from rolledger.workers.weights.transport import DeltaBase, load_verified


class TorchEngine:
    """An Engine over an in-process HF causal LM (see the module docstring for the rules it enforces)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        rank: int = 0,
        policy_version: int = 0,
        device: str = "cpu",
        prefix_cache: bool = True,
        prefix_cache_entries: int = 256,
        pause_timeout_s: float = 60.0,
        keep_timeout_s: float = 300.0,
        probe_text: str = "12+34=",
        interruptible: bool = False,
        batch_groups: bool = False,
        max_batch_groups: int | None = None,
    ) -> None:
        if prefix_cache_entries < 1:
            raise ValueError(f"prefix_cache_entries must be >= 1 (got {prefix_cache_entries})")
        self.rank = rank
        self.interruptible = interruptible
        self.device = torch.device(device)
        self._model: Any = cast(Any, model).to(self.device).eval()  # an HF causal LM (PreTrainedModel)
        self._tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("tokenizer has no eos_token_id")
        self._eos_id = int(eos)
        pad = getattr(tokenizer, "pad_token_id", None)
        self._pad_id = int(pad) if pad is not None else self._eos_id
        self._vocab_size = int(self._model.config.vocab_size)
        self._max_positions = int(getattr(self._model.config, "max_position_embeddings", 1 << 30))
        self._probe_ids: list[int] = list(tokenizer(probe_text)["input_ids"])

        self._use_prefix_cache = prefix_cache
        self._prefix = PrefixCache(prefix_cache_entries)
        self._decoder = KVDecoder(
            self._model,
            device=self.device,
            eos_id=self._eos_id,
            pad_id=self._pad_id,
            prefix=self._prefix if prefix_cache else None,
        )

        self._params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        self._specs: dict[str, TensorSpec] = {
            n: TensorSpec(shape=tuple(p.shape), dtype=dtype_name(p.dtype)) for n, p in self._params.items()
        }
        self._torch_dtypes: dict[str, torch.dtype] = {n: p.dtype for n, p in self._params.items()}

        self._model_lock = threading.Lock()  # every use of the model / its parameters / the prefix cache
        self._state = threading.Condition()  # flags below; notified on every change
        self._paused: PauseMode | None = None
        self._abort = threading.Event()
        self._inflight = 0
        self._parked = 0
        self._sleep = SleepState()  # per-tag sleep state and its rules (workers/engines/sleep_state)
        self._host_copy: dict[str, torch.Tensor] | None = None
        self._staged: torch_weights.StagedWeights | None = None
        self._closed = False
        self._pause_timeout_s = pause_timeout_s
        self._keep_timeout_s = keep_timeout_s

        # batch_groups: concurrent generate calls share one decode batch, run by one decode thread (torch_batch)
        self._batch_groups = batch_groups
        self._pending: list[BatchRequest] = []  # submitted, not yet taken by the decode thread (under _state)
        self._decode_thread: threading.Thread | None = None
        self._batcher = GroupBatcher(
            self._decoder,
            self._model.config,
            eos_id=self._eos_id,
            device=self.device,
            take=self._take_pending,
            pending=lambda: len(self._pending),
            poll=self._poll_control,
            serving=lambda: (self._policy_version, self._digest),
            stamp=self._output,
            max_groups=max_batch_groups,
        )

        self._policy_version = policy_version
        self._cache_generation = 0
        self._graph_generation = 0
        self._digest = state_digest(policy_state(self._model))
        self.stats = EngineStats()

    # ------------------------------------------------------------------ properties

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            name="torch",
            sleep_levels=(1, 2),
            prefix_cache=self._use_prefix_cache,
            logprob_mode="raw",
            logprob_mode_per_request=True,  # torch_decode reports raw or processed as each request's sampling says
            streams_samples=True,
            interruptible=self.interruptible,
        )

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def cache_generation(self) -> int:
        return self._cache_generation

    @property
    def graph_generation(self) -> int:
        return self._graph_generation

    @property
    def is_paused(self) -> bool:
        with self._state:
            return self._paused is not None

    @property
    def asleep_level(self) -> int:
        with self._state:
            return self._sleep.asleep_level

    @property
    def sleep_state(self) -> SleepState:
        """Which tags sleep (an immutable snapshot)."""
        with self._state:
            return self._sleep

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
        validate_request(prompt, n, sampling, self._vocab_size, self._max_positions)
        with self._state:
            self._check_open()
            if self._paused is not None:
                raise IllegalEngineOrder(f"rank {self.rank}: generate while paused ({self._paused})")
            self._check_serving("generate")
            # taken now: a commit waits for it to finish or park, so the one-group path decodes from this version
            refuse_unless_serving(expect_version, self._policy_version, self.rank)
            self._inflight += 1
            if self._batch_groups:
                req = BatchRequest(
                    prompt,
                    n,
                    sampling,
                    should_cancel,
                    streams=on_sample is not None,
                    taken_on=(self._policy_version, self._digest),
                )
                self._pending.append(req)
                thread = self._start_decode_thread()
                self._state.notify_all()
        started = time.perf_counter()
        try:
            if self._batch_groups:
                out = wait_for(req, on_sample, thread.is_alive)  # stamped by the decode thread, under the lock
            else:
                self._model_lock.acquire()
                try:
                    out = self._output(self._decode(prompt, n, sampling, should_cancel, on_sample))
                finally:
                    self._model_lock.release()
        finally:
            with self._state:
                self._inflight -= 1
                self._state.notify_all()
        with self._state:
            aborted = [s for s in out.samples if s.finish_reason == "abort"]
            self.stats.cancelled_samples += len(aborted)
            self.stats.cancelled_tokens += sum(len(s.token_ids) for s in aborted)
            if self._batch_groups:
                c = self._batcher.counters
                self.stats.extra["batch_max_groups"] = float(c.max_groups)
                self.stats.extra["batch_mean_groups"] = c.group_steps / c.steps if c.steps else 0.0
                self.stats.extra["batch_step_ms"] = 1e3 * c.step_s / c.steps if c.steps else 0.0
                self.stats.extra["batch_steps"] = float(c.steps)
                self.stats.extra["batch_step_s"] = c.step_s
            self.stats.groups += 1
            self.stats.generated_tokens += sum(len(s.token_ids) for s in out.samples)
            self.stats.prefill_tokens_computed += out.prefill_tokens_computed
            self.stats.prefill_tokens_saved += out.prefill_tokens_saved
            self.stats.extra["generate_s"] = self.stats.extra.get("generate_s", 0.0) + time.perf_counter() - started
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"rank {self.rank}: engine is closed")

    def _check_serving(self, what: str) -> None:
        """Caller holds self._state."""
        self._sleep.check_serving(what, self.rank)

    def _decode(
        self,
        prompt: list[int],
        n: int,
        sampling: SamplingParams,
        should_cancel: Callable[[int], bool] | None,
        on_sample: Callable[[int, SampleOutput], None] | None = None,
    ) -> Decoded:
        """One group alone, in the calling thread, which holds the model lock."""
        return self._decoder.decode(
            prompt,
            n,
            sampling,
            serving=lambda: (self._policy_version, self._digest),
            poll=self._poll_control,
            should_cancel=should_cancel,
            on_sample=on_sample,
        )

    def _start_decode_thread(self) -> threading.Thread:
        """The decode thread of batch_groups, started on first use (caller holds self._state)."""
        if self._decode_thread is None or not self._decode_thread.is_alive():
            self._decode_thread = threading.Thread(
                target=self._decode_loop, name=f"torch-decode-rank{self.rank}", daemon=True
            )
            self._decode_thread.start()
        return self._decode_thread

    def _decode_loop(self) -> None:
        """Run the shared decode batch whenever requests are pending; end when the engine closes."""
        while True:
            with self._state:
                while not self._pending and not self._closed:
                    self._state.wait()
                if not self._pending:
                    return
            with self._model_lock:
                self._batcher.run()

    def _take_pending(self) -> list[BatchRequest]:
        with self._state:
            taken, self._pending = self._pending, []
            return taken

    def _output(self, out: Decoded) -> GroupOutput:
        """A decoded group stamped with what serves now; called with the model lock held (no commit in between)."""
        return GroupOutput(
            samples=out.samples,
            policy_version=out.policy_version,
            weights_digest=self._digest,
            cache_generation=self._cache_generation,
            graph_generation=self._graph_generation,
            prefill_tokens_computed=out.prefill_tokens_computed,
            prefill_tokens_saved=out.prefill_tokens_saved,
        )

    def _poll_control(self, version: int, held: Callable[[], int] | None = None) -> bool:
        """Called with the model lock held between decode steps. False: end the unfinished samples ("abort").

        Under pause("keep") the generation parks here with the model lock released until resume/abort/deadline;
        it continues only if the engine still serves the same policy version. `held()`: how many generate calls
        this park holds (the decode thread of batch_groups parks every group of its batch at once); one otherwise.
        """
        if self._abort.is_set():
            return False
        with self._state:
            if self._paused != "keep":
                return True
        self._model_lock.release()
        try:
            deadline = time.monotonic() + self._keep_timeout_s
            with self._state:
                count = held() if held is not None else 1
                self._parked += count
                self._state.notify_all()
                try:
                    while self._paused == "keep" and not self._abort.is_set():
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return False
                        self._state.wait(left)
                        now = held() if held is not None else 1
                        if now != count:
                            self._parked += now - count
                            count = now
                            self._state.notify_all()
                finally:
                    self._parked -= count
                    self._state.notify_all()
        finally:
            self._model_lock.acquire()
        if self._abort.is_set() or (self._policy_version != version and not self.interruptible):
            return False
        with self._state:
            return self._sleep.serving

    # ------------------------------------------------------------------ pause / resume

    def pause(self, mode: PauseMode, *, timeout_s: float | None = None) -> None:
        """Stop admitting generations; return when in-flight ones are quiescent (see module docstring)."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep' (got {mode!r})")
        deadline = time.monotonic() + (self._pause_timeout_s if timeout_s is None else timeout_s)
        with self._state:
            self._check_open()
            self._paused = mode
            if mode == "abort":
                self._abort.set()
            self._state.notify_all()

            def quiescent() -> bool:
                return self._inflight == 0 or (mode == "keep" and self._parked == self._inflight)

            while not quiescent():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(
                        f"rank {self.rank}: pause({mode!r}) timed out with {self._inflight} generation(s) in flight"
                    )
                self._state.wait(left)

    def resume(self) -> None:
        with self._state:
            self._check_open()
            self._paused = None
            self._abort.clear()
            self._state.notify_all()

    # ------------------------------------------------------------------ sleep / wake

    def _param_bytes(self) -> int:
        return torch_memory.param_bytes(self._params)

    def _cache_bytes(self) -> int:
        return self._prefix.nbytes()

    def accounted_bytes(self) -> int:
        """What this rank holds in (device) memory: live parameter storage + prefix-cache KV."""
        with self._model_lock:
            return self._param_bytes() + self._cache_bytes()

    def host_bytes(self) -> int:
        """Bytes of the level-1 host copy (0 when there is none)."""
        with self._model_lock:
            return torch_memory.host_bytes(self._host_copy)

    def sleep(self, level: int) -> SleepReport:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2 (got {level})")
        with self._model_lock, self._state:
            self._check_open()
            slept = self._sleep.slept(level, self.rank)
            if self._inflight:
                raise IllegalEngineOrder(
                    f"rank {self.rank}: sleep({level}) with {self._inflight} generation(s) in flight; pause first"
                )
            if self._staged is not None:
                raise IllegalEngineOrder(
                    f"rank {self.rank}: sleep({level}) with staged weights v{self._staged.version} pending; "
                    "commit or discard them first"
                )
            before = self._param_bytes() + self._cache_bytes()
            weight_bytes = self._param_bytes()
            self._host_copy = torch_memory.host_copy_of(self._params, self.device) if level == 1 else None
            torch_memory.release(self._params, self.device)
            self._drop_prefix_cache()
            after = self._param_bytes() + self._cache_bytes()
            host = torch_memory.host_bytes(self._host_copy)
            if self.device.type != "cpu":
                torch.cuda.empty_cache()
            verified = after == 0 and (host >= weight_bytes if level == 1 else self._host_copy is None)
            self._sleep = slept
            self._state.notify_all()
        return SleepReport(level=level, bytes_before=before, bytes_after=after, verified=verified)

    def wake(self, tags: Sequence[WakeTag]) -> WakeReport:
        restored = 0
        with self._model_lock, self._state:
            self._check_open()
            after, woken = self._sleep.woken(tags, self.rank)
            if "weights" in woken:
                restored += self._restore_weights(self._sleep.level)
            # kv_cache: nothing to allocate eagerly; the prefix cache refills on demand
            self._sleep = after
            self._state.notify_all()
        return WakeReport(tags=tuple(t for t in TAGS if t in tags), bytes_restored=restored)

    def _restore_weights(self, level: int) -> int:
        """Caller holds both locks. Level 1: bring the host copy back; level 2: reallocate, invalid until commit."""
        host_copy = self._host_copy if level == 1 else None
        shapes = {name: spec.shape for name, spec in self._specs.items()}
        torch_memory.restore(self._params, host_copy, shapes, self._torch_dtypes, self.device)
        self._host_copy = None
        return self._param_bytes()

    # ------------------------------------------------------------------ weights

    def live_tensor_specs(self) -> Mapping[str, TensorSpec]:
        return dict(self._specs)

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> str:
        with self._state:
            self._check_open()
            self._sleep.check_weights_awake(f"stage v{version}", self.rank)
        torch_weights.validate_update(self._specs, tensors)
        staged = torch_weights.stage_buffer(version, tensors, self.device)
        with self._state:
            self._staged = staged
        return staged.digest

    def prepare(self, version: int, uri: str, manifest: WeightManifest) -> str:
        """Load the update at `uri` through the verified path (every checksum), then stage it. The weights it serves
        are offered as the base of a delta (a transport that sends one checks the result against the manifest)."""
        return self.stage_weights(version, dict(load_verified(uri, version, manifest, base=self._delta_base())))

    def _delta_base(self) -> DeltaBase | None:
        """The live weights and their version, while they are valid and awake on the host; None otherwise."""
        with self._state:
            if not self._sleep.serving or self.device.type != "cpu":
                return None
            return DeltaBase(self._policy_version, policy_state(self._model))

    def commit_weights(self, version: int) -> CommitReport:
        with self._model_lock, self._state:
            self._check_open()
            self._sleep.check_weights_awake(f"commit v{version}", self.rank)
            staged = self._staged
            if staged is None:
                raise IllegalEngineOrder(f"rank {self.rank}: commit v{version} with nothing staged")
            if staged.version != version:
                raise IllegalEngineOrder(f"rank {self.rank}: commit v{version} but v{staged.version} is staged")
            same_shapes = torch_weights.copy_into(self._params, staged)
            self._staged = None
            self._sleep = self._sleep.committed()
            self._policy_version = version
            self._drop_prefix_cache()
            if not same_shapes:
                self._graph_generation += 1
            self._digest = state_digest(policy_state(self._model))
            self._state.notify_all()
            return CommitReport(
                policy_version=version,
                weights_digest=self._digest,
                cache_generation=self._cache_generation,
                graph_generation=self._graph_generation,
                graphs_invalidated=not same_shapes,
            )

    def discard_weights(self) -> None:
        with self._state:
            self._staged = None

    @property
    def staged_version(self) -> int | None:
        with self._state:
            return self._staged.version if self._staged is not None else None

    def _drop_prefix_cache(self) -> int:
        """Caller holds the model lock."""
        self._prefix.clear()
        self._cache_generation += 1
        return self._cache_generation

    def reset_prefix_cache(self) -> int:
        with self._model_lock:
            return self._drop_prefix_cache()

    def kv_cache_tokens(self) -> int | None:
        """None: the torch engine allocates its KV cache per group, as it decodes."""
        return None

    def weights_digest(self) -> str:
        """state_digest of the live weights, measured from the parameters when they were made live (at construction
        and by every commit; a level-1 wake puts the same bytes back, a level-2 one serves nothing until a commit):
        the digest `generate` stamps its samples with. Not recomputed per call: a rank asks for it per group, and a
        pass over every parameter per group would cost a real model seconds (vLLM's worker keeps it the same way)."""
        with self._state:
            self._check_serving("weights_digest")
            return self._digest

    def health(self) -> HealthReport:
        """Greedy 4-token decode of a fixed probe (full forward each step); fails on NaN/inf or an engine error."""
        with self._model_lock, self._state:
            if self._closed:
                return HealthReport(ok=False, detail="engine is closed")
            if not self._sleep.serving:
                return HealthReport(ok=False, detail=f"not serving: {self._sleep.describe()}")
            return self._decoder.probe(self._probe_ids)

    def close(self) -> None:
        with self._state:
            self._closed = True
            self._abort.set()
            self._staged = None
            self._state.notify_all()
        with self._model_lock:
            self._prefix.clear()
