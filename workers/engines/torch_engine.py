"""The built-in torch engine: one inference rank running a Hugging Face causal LM in-process.

Owns KV-cache decoding of groups with a real prefix cache, sampling (temperature / top-k / top-p / seed / stop ids)
with raw or processed logprobs, pause/resume, sleep/wake with measured (accounted) memory, and the two-step weight
update (stage into an inactive buffer, commit by copying into the live parameters).

Rules this engine enforces (IllegalEngineOrder otherwise):
- generate: refused while paused, while any sleep tag is still asleep, and while the live weights are not valid
  (after a level-2 sleep the weights are reallocated by wake(["weights"]) but hold garbage until a commit).
- pause(mode): "abort" ends running generations at their next decode step (unfinished samples -> "abort");
  "wait" lets them finish; "keep" parks them at their next decode step (releasing the model lock) until resume().
  pause returns once in-flight work is quiescent (finished, or parked for "keep"), within a deadline.
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

Prefix accounting: for a group of n samples over a prompt of L tokens, prefill_tokens_computed is what actually ran
through the model and prefill_tokens_saved = n*L - computed (what a per-sample prefill would have cost beyond it).
With the prefix cache the prompt is prefilled once at batch 1 and its KV expanded to n; the prefix cache (an LRU of
prompt token tuple -> batch-1 KV + last logits) serves the longest common prefix with any cached prompt (its KV
sliced), so only the tail is computed, and nothing at all on an exact hit; without it (prefix_cache=False) the
prompt runs at batch n.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import xxhash
from transformers import DynamicCache

from rolledger.schemas.config import SamplingParams
from rolledger.schemas.weights import WeightManifest
from rolledger.workers.engine import (
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
)
from rolledger.workers.policy_model import policy_state
from rolledger.workers.staging import load_verified
from rolledger.workers.weights import dtype_name, state_digest

FinishReason = Literal["stop", "length", "abort"]
_WAKE_ORDER: tuple[WakeTag, ...] = ("weights", "kv_cache")


_KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values)


@dataclass
class _PrefixEntry:
    kv: _KV  # per layer (keys, values), batch 1, never mutated
    last_logits: torch.Tensor  # [vocab] float32, the logits after the prompt's last token
    nbytes: int


@dataclass
class _Staged:
    version: int
    tensors: dict[str, torch.Tensor]
    digest: str


def _common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


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

        forward_params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward_params else "past_key_values"
        self._use_prefix_cache = prefix_cache
        self._prefix_capacity = prefix_cache_entries
        self._prefix: OrderedDict[tuple[int, ...], _PrefixEntry] = OrderedDict()

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
        self._asleep_tags: set[str] = set()
        self._sleep_level = 0
        self._weights_valid = True
        self._host_copy: dict[str, torch.Tensor] | None = None
        self._staged: _Staged | None = None
        self._closed = False
        self._pause_timeout_s = pause_timeout_s
        self._keep_timeout_s = keep_timeout_s

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
            return self._sleep_level if self._asleep_tags else 0

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        n: int,
        sampling: SamplingParams,
        *,
        should_cancel: Callable[[int], bool] | None = None,
        on_sample: Callable[[int, SampleOutput], None] | None = None,
    ) -> GroupOutput:
        prompt = [int(t) for t in prompt_token_ids]
        self._validate_request(prompt, n, sampling)
        with self._state:
            self._check_open()
            if self._paused is not None:
                raise IllegalEngineOrder(f"rank {self.rank}: generate while paused ({self._paused})")
            self._check_serving("generate")
            self._inflight += 1
        started = time.perf_counter()
        try:
            self._model_lock.acquire()
            try:
                out = self._generate_locked(prompt, n, sampling, should_cancel, on_sample)
            finally:
                self._model_lock.release()
        finally:
            with self._state:
                self._inflight -= 1
                self._state.notify_all()
        with self._state:
            self.stats.groups += 1
            self.stats.generated_tokens += sum(len(s.token_ids) for s in out.samples)
            self.stats.prefill_tokens_computed += out.prefill_tokens_computed
            self.stats.prefill_tokens_saved += out.prefill_tokens_saved
            self.stats.extra["generate_s"] = self.stats.extra.get("generate_s", 0.0) + time.perf_counter() - started
        return out

    def _validate_request(self, prompt: list[int], n: int, sampling: SamplingParams) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1 (got {n})")
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        bad = [t for t in prompt if not 0 <= t < self._vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids holds ids outside the vocabulary [0, {self._vocab_size}): {bad[:5]}")
        if len(prompt) + sampling.max_tokens > self._max_positions:
            raise ValueError(
                f"sampling.max_tokens={sampling.max_tokens} with a {len(prompt)}-token prompt exceeds the model's "
                f"max_position_embeddings={self._max_positions}"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"rank {self.rank}: engine is closed")

    def _check_serving(self, what: str) -> None:
        """Caller holds self._state."""
        if self._asleep_tags:
            raise IllegalEngineOrder(
                f"rank {self.rank}: {what} while asleep (level {self._sleep_level}, "
                f"tags still asleep: {sorted(self._asleep_tags)})"
            )
        if not self._weights_valid:
            raise IllegalEngineOrder(
                f"rank {self.rank}: {what} before new weights were committed after a level-2 sleep"
            )

    @torch.inference_mode()
    def _generate_locked(
        self,
        prompt: list[int],
        n: int,
        sampling: SamplingParams,
        should_cancel: Callable[[int], bool] | None,
        on_sample: Callable[[int, SampleOutput], None] | None = None,
    ) -> GroupOutput:
        version = self._policy_version
        cache, logits, computed, saved = self._prefill(prompt, n)
        gen = torch.Generator(device=self.device)
        if sampling.seed is not None:
            gen.manual_seed(sampling.seed)
        else:
            gen.seed()
        stops = set(sampling.stop_token_ids) | {self._eos_id}
        spans: list[list[tuple[int, int, str]]] = [[(0, version, self._digest)] for _ in range(n)]
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        finish: list[FinishReason | None] = [None] * n

        for step in range(sampling.max_tokens):
            if not self._poll_control(version):
                finish = [f if f is not None else "abort" for f in finish]
                break
            if self._policy_version != version:  # interruptible: new weights were committed while parked
                version = self._policy_version
                for i in range(n):
                    if finish[i] is None:
                        spans[i].append((len(tokens[i]), version, self._digest))
            if should_cancel is not None:
                for i in range(n):
                    if finish[i] is None and should_cancel(i):
                        finish[i] = "abort"
            if all(f is not None for f in finish):
                break
            next_ids, raw_lp, proc_lp = self._sample(logits, sampling, gen)
            chosen = raw_lp if sampling.logprob_mode == "raw" else proc_lp
            for i in range(n):
                if finish[i] is not None:
                    continue
                tok = int(next_ids[i])
                tokens[i].append(tok)
                logprobs[i].append(float(chosen[i]))
                if tok in stops:
                    finish[i] = "stop"
                elif step == sampling.max_tokens - 1:
                    finish[i] = "length"
                if finish[i] is not None and on_sample is not None:  # stream each sample as soon as it ends
                    on_sample(
                        i,
                        SampleOutput(
                            token_ids=list(tokens[i]),
                            logprobs=list(logprobs[i]),
                            finish_reason=finish[i],  # type: ignore[arg-type]
                            spans=tuple(spans[i]) if len(spans[i]) > 1 else (),
                        ),
                    )
            if all(f is not None for f in finish):
                break
            feed = torch.tensor(
                [[int(next_ids[i]) if finish[i] is None else self._pad_id] for i in range(n)], device=self.device
            )
            out = self._forward(feed, cache)
            cache = self._out_cache(out)
            logits = out.logits[:, -1, :].float()

        samples = [
            SampleOutput(
                token_ids=tokens[i],
                logprobs=logprobs[i],
                finish_reason=finish[i] or "length",
                spans=tuple(spans[i]) if len(spans[i]) > 1 else (),
            )
            for i in range(n)
        ]
        return GroupOutput(
            samples=samples,
            policy_version=version,
            weights_digest=self._digest,
            cache_generation=self._cache_generation,
            graph_generation=self._graph_generation,
            prefill_tokens_computed=computed,
            prefill_tokens_saved=saved,
        )

    def _poll_control(self, version: int) -> bool:
        """Called with the model lock held between decode steps. False: end the unfinished samples ("abort").

        Under pause("keep") the generation parks here with the model lock released until resume/abort/deadline;
        it continues only if the engine still serves the same policy version.
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
                self._parked += 1
                self._state.notify_all()
                try:
                    while self._paused == "keep" and not self._abort.is_set():
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return False
                        self._state.wait(left)
                finally:
                    self._parked -= 1
                    self._state.notify_all()
        finally:
            self._model_lock.acquire()
        if self._abort.is_set() or (self._policy_version != version and not self.interruptible):
            return False
        with self._state:
            return not self._asleep_tags and self._weights_valid

    def _forward(self, input_ids: torch.Tensor, cache: DynamicCache | None) -> Any:
        """One forward with a KV cache; transformers 5.x names it `cache`, older releases `past_key_values`."""
        kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": True}
        if cache is not None:
            kwargs[self._cache_kw] = cache
        return self._model(**kwargs)

    @staticmethod
    def _out_cache(out: Any) -> DynamicCache:
        cache = out.get("cache") if hasattr(out, "get") else None
        return cache if cache is not None else out.past_key_values

    def _prefill(self, prompt: list[int], n: int) -> tuple[DynamicCache, torch.Tensor, int, int]:
        """KV cache of the prompt expanded to batch n, the next-token logits [n, vocab], computed and saved counts."""
        length = len(prompt)
        config = self._model.config
        if not self._use_prefix_cache:
            ids = torch.tensor([prompt] * n, device=self.device)
            out = self._forward(ids, None)
            return self._out_cache(out), out.logits[:, -1, :].float(), n * length, 0

        key = tuple(prompt)
        cached_kv, matched, cached_last = self._lookup_prefix(key)
        if cached_kv is not None and cached_last is not None:
            computed = 0
            kv, last = cached_kv, cached_last
        else:
            base = DynamicCache(ddp_cache_data=cached_kv, config=config) if cached_kv is not None else None
            ids = torch.tensor([prompt[matched:]], device=self.device)
            out = self._forward(ids, base)
            kv = [
                (cast(torch.Tensor, layer.keys), cast(torch.Tensor, layer.values))
                for layer in cast(Any, self._out_cache(out)).layers
            ]
            last = out.logits[0, -1, :].float()
            computed = length - matched
            self._store_prefix(key, _PrefixEntry(kv=kv, last_logits=last, nbytes=self._entry_bytes(kv, last)))
        expanded = [(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1)) for k, v in kv]
        cache = DynamicCache(ddp_cache_data=expanded, config=config)  # copies: the stored entry is never touched
        return cache, last.unsqueeze(0).expand(n, -1), computed, n * length - computed

    def _lookup_prefix(self, key: tuple[int, ...]) -> tuple[_KV | None, int, torch.Tensor | None]:
        """The cached KV sharing the longest common prefix with `key`: (kv sliced to it, its length, last logits).

        The last logits come back only on an exact hit; otherwise at least the prompt's last token is recomputed.
        """
        hit = self._prefix.get(key)
        if hit is not None:
            self._prefix.move_to_end(key)
            return hit.kv, len(key), hit.last_logits
        best_key: tuple[int, ...] | None = None
        best = 0
        for cached in self._prefix:
            m = _common_prefix_len(cached, key)
            if m > best:
                best_key, best = cached, m
        best = min(best, len(key) - 1)  # the logits after the last prompt token must be computed
        if best_key is None or best < 1:
            return None, 0, None
        self._prefix.move_to_end(best_key)
        kv = [(k[:, :, :best], v[:, :, :best]) for k, v in self._prefix[best_key].kv]
        return kv, best, None

    def _store_prefix(self, key: tuple[int, ...], entry: _PrefixEntry) -> None:
        self._prefix[key] = entry
        self._prefix.move_to_end(key)
        while len(self._prefix) > self._prefix_capacity:
            self._prefix.popitem(last=False)

    @staticmethod
    def _entry_bytes(kv: _KV, last: torch.Tensor) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv) + (
            last.numel() * last.element_size()
        )

    @staticmethod
    def _sample(
        logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Next tokens [n], their raw logprobs (unmodified logits) and processed logprobs (after T/top-k/top-p)."""
        raw = torch.log_softmax(logits, dim=-1)
        if sampling.temperature == 0.0:
            chosen = logits.argmax(dim=-1)
            return chosen, raw.gather(-1, chosen[:, None])[:, 0], torch.zeros_like(chosen, dtype=raw.dtype)
        x = logits / sampling.temperature
        if sampling.top_k > 0 and sampling.top_k < x.shape[-1]:
            kth = torch.topk(x, sampling.top_k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if sampling.top_p < 1.0:
            sorted_x, order = torch.sort(x, dim=-1, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
            sorted_x = sorted_x.masked_fill(before >= sampling.top_p, float("-inf"))  # the top token always stays
            x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
        processed = torch.log_softmax(x, dim=-1)
        chosen = torch.multinomial(processed.exp(), 1, generator=gen)[:, 0]
        return chosen, raw.gather(-1, chosen[:, None])[:, 0], processed.gather(-1, chosen[:, None])[:, 0]

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
        seen: set[int] = set()
        total = 0
        for p in self._params.values():
            storage = p.data.untyped_storage()
            if storage.data_ptr() in seen and storage.nbytes() > 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    def _cache_bytes(self) -> int:
        return sum(e.nbytes for e in self._prefix.values())

    def accounted_bytes(self) -> int:
        """What this rank holds in (device) memory: live parameter storage + prefix-cache KV."""
        with self._model_lock:
            return self._param_bytes() + self._cache_bytes()

    def host_bytes(self) -> int:
        """Bytes of the level-1 host copy (0 when there is none)."""
        with self._model_lock:
            return sum(_nbytes(t) for t in self._host_copy.values()) if self._host_copy else 0

    def sleep(self, level: int) -> SleepReport:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2 (got {level})")
        with self._model_lock, self._state:
            self._check_open()
            if self._asleep_tags:
                raise IllegalEngineOrder(f"rank {self.rank}: sleep({level}) while already asleep")
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
            if level == 1:
                on_cpu = self.device.type == "cpu"
                pin = torch.cuda.is_available() and not on_cpu
                self._host_copy = {
                    n: (p.data if on_cpu else p.data.to("cpu", copy=True).pin_memory() if pin else p.data.cpu())
                    for n, p in self._params.items()
                }
            else:
                self._host_copy = None
            for p in self._params.values():
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
            self._drop_prefix_cache()
            after = self._param_bytes() + self._cache_bytes()
            host = sum(_nbytes(t) for t in self._host_copy.values()) if self._host_copy else 0
            if self.device.type != "cpu":
                torch.cuda.empty_cache()
            verified = after == 0 and (host >= weight_bytes if level == 1 else self._host_copy is None)
            self._asleep_tags = {"weights", "kv_cache"}
            self._sleep_level = level
            self._state.notify_all()
        return SleepReport(level=level, bytes_before=before, bytes_after=after, verified=verified)

    def wake(self, tags: Sequence[WakeTag]) -> WakeReport:
        requested = set(tags)
        unknown = requested - set(_WAKE_ORDER)
        if not requested or unknown:
            raise ValueError(f"wake tags must be a non-empty subset of {list(_WAKE_ORDER)} (got {list(tags)})")
        restored = 0
        with self._model_lock, self._state:
            self._check_open()
            if "kv_cache" in requested and "weights" in self._asleep_tags and "weights" not in requested:
                raise IllegalEngineOrder(f"rank {self.rank}: wake kv_cache before weights")
            for tag in _WAKE_ORDER:
                if tag not in requested or tag not in self._asleep_tags:
                    continue
                if tag == "weights":
                    restored += self._restore_weights()
                # kv_cache: nothing to allocate eagerly; the prefix cache refills on demand
                self._asleep_tags.discard(tag)
            if not self._asleep_tags:
                self._sleep_level = 0
            self._state.notify_all()
        return WakeReport(tags=tuple(t for t in _WAKE_ORDER if t in requested), bytes_restored=restored)

    def _restore_weights(self) -> int:
        """Caller holds both locks. Level 1: bring the host copy back; level 2: reallocate, invalid until commit."""
        for name, p in self._params.items():
            if self._sleep_level == 1 and self._host_copy is not None:
                p.data = self._host_copy[name].to(self.device)
            else:
                p.data = torch.empty(self._specs[name].shape, dtype=self._torch_dtypes[name], device=self.device)
        if self._sleep_level == 2:
            self._weights_valid = False
        self._host_copy = None
        return self._param_bytes()

    # ------------------------------------------------------------------ weights

    def live_tensor_specs(self) -> Mapping[str, TensorSpec]:
        return dict(self._specs)

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> str:
        with self._state:
            self._check_open()
            if "weights" in self._asleep_tags:
                raise IllegalEngineOrder(f"rank {self.rank}: never update weights while asleep (stage v{version})")
        for name, t in tensors.items():
            spec = self._specs.get(name)
            if spec is None:
                raise WeightValidationError(name, "not a tensor of the live model")
            if not isinstance(t, torch.Tensor):
                raise WeightValidationError(name, f"expected a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != spec.shape:
                raise WeightValidationError(name, f"shape {tuple(t.shape)} != live {spec.shape}")
            if dtype_name(t.dtype) != spec.dtype:
                raise WeightValidationError(name, f"dtype {dtype_name(t.dtype)} != live {spec.dtype}")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise WeightValidationError(name, "holds NaN or inf")
        missing = sorted(set(self._specs) - set(tensors))
        if missing:
            raise WeightValidationError(missing[0], f"missing from the staged weights ({len(missing)} missing)")
        buffer = {name: t.detach().to(self.device, copy=True) for name, t in tensors.items()}
        digest = state_digest(buffer)
        with self._state:
            self._staged = _Staged(version=version, tensors=buffer, digest=digest)
        return digest

    def prepare(self, version: int, uri: str, manifest: WeightManifest) -> str:
        """Load the update at `uri` through the verified path (every checksum), then stage it."""
        return self.stage_weights(version, dict(load_verified(uri, version, manifest)))

    def commit_weights(self, version: int) -> CommitReport:
        with self._model_lock, self._state:
            self._check_open()
            if "weights" in self._asleep_tags:
                raise IllegalEngineOrder(f"rank {self.rank}: never update weights while asleep (commit v{version})")
            staged = self._staged
            if staged is None:
                raise IllegalEngineOrder(f"rank {self.rank}: commit v{version} with nothing staged")
            if staged.version != version:
                raise IllegalEngineOrder(f"rank {self.rank}: commit v{version} but v{staged.version} is staged")
            same_shapes = all(tuple(p.shape) == tuple(staged.tensors[n].shape) for n, p in self._params.items())
            for name, p in self._params.items():
                if same_shapes:
                    p.data.copy_(staged.tensors[name])
                else:  # never reached after validation; kept so a shape change is handled honestly
                    p.data = staged.tensors[name]
            self._staged = None
            self._weights_valid = True
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

    def weights_digest(self) -> str:
        """state_digest of the live weights, recomputed from the parameters (not a remembered value)."""
        with self._model_lock, self._state:
            self._check_serving("weights_digest")
            return state_digest(policy_state(self._model))

    @torch.inference_mode()
    def health(self) -> HealthReport:
        """Greedy 4-token decode of a fixed probe (full forward each step); fails on NaN/inf or an engine error."""
        with self._model_lock, self._state:
            if self._closed:
                return HealthReport(ok=False, detail="engine is closed")
            if self._asleep_tags or not self._weights_valid:
                return HealthReport(ok=False, detail="weights are asleep or not committed")
            h = xxhash.xxh3_128()
            try:
                ids = list(self._probe_ids)
                for _ in range(4):
                    logits = self._model(input_ids=torch.tensor([ids], device=self.device)).logits[0, -1].float()
                    if not bool(torch.isfinite(logits).all()):
                        return HealthReport(ok=False, detail=f"non-finite logits at probe position {len(ids)}")
                    h.update(logits.cpu().numpy().tobytes())  # the exact logits: ranks on other weights cannot match
                    ids.append(int(logits.argmax()))
            except Exception as exc:  # noqa: BLE001 - an engine error is a failed probe, not a crash of the caller
                return HealthReport(ok=False, detail=f"probe forward failed: {exc!r}")
        generated = ids[len(self._probe_ids) :]
        h.update(",".join(map(str, ids)).encode())
        digest = h.hexdigest()
        return HealthReport(ok=True, detail=f"probe greedy tokens {generated}", probe_digest=digest)

    def close(self) -> None:
        with self._state:
            self._closed = True
            self._abort.set()
            self._staged = None
            self._state.notify_all()
        with self._model_lock:
            self._prefix.clear()
