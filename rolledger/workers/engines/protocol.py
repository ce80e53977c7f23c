"""The Engine protocol: what a rollout rank can do, implemented by the built-in torch engine and the vLLM and SGLang
engines (one contract suite, tests/engine_contract.py, runs against all three).

An engine is one inference rank. It generates groups (one prompt, N samples sharing the prompt prefix), can be
paused and resumed, put to sleep and woken by tags, and takes new weights in two steps: `stage_weights` validates
into an inactive buffer (the live weights keep serving), `commit_weights` swaps them in and invalidates what the old
weights produced. `prepare` is the one way a rank stages a staged update: read from its URI, every checksum verified
(an in-process engine through workers.weights.staging_loader.load_verified, a remote one in its own workers). Everything it
reports is plain data the workers stamp into events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

from rolledger.schemas.config import SamplingParams
from rolledger.schemas.weights import WeightManifest

PauseMode = Literal["abort", "wait", "keep"]
WakeTag = Literal["weights", "kv_cache"]


class EngineError(RuntimeError):
    """An engine refused or failed an operation; the message says which and why."""


class IllegalEngineOrder(EngineError):
    """An operation out of the legal order: weights sent while asleep, resume before the health probe, ..."""


class StaleRequest(IllegalEngineOrder):
    """generate(expect_version=v) reached an engine that serves another version: between the caller reading the
    version (and logging its samples as started on it) and its request, a whole update committed. Refused, so that no
    sample runs on weights other than those its start was stamped with; the caller cuts it before its first token."""


def refuse_unless_serving(expect_version: int | None, serving: int, rank: int) -> None:
    """Raise StaleRequest when a request expects a version other than the one serving (None: no expectation).
    Called where the engine takes the request, under the lock a commit also takes."""
    if expect_version is not None and expect_version != serving:
        raise StaleRequest(f"rank {rank}: request expects v{expect_version} but v{serving} serves")


def cut_until_answered(
    cond: threading.Condition,
    in_flight: Callable[[], int],
    cut_again: Callable[[], None],
    *,
    poll_s: float,
    timeout_s: float,
    what: str,
) -> None:
    """After a server's pause with abort: return once `in_flight()` (read under `cond`, which is notified as each
    answer comes back) is 0. While a request is unanswered after `poll_s`, `cut_again()` asks the server to cut what
    it holds (a request that passed the engine's check just before the pause can reach the server after it); a
    request still on its way is caught by a later round. EngineError after `timeout_s`, naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        with cond:
            if in_flight():
                cond.wait(timeout=poll_s)  # woken as each answer comes back
            left = in_flight()
            if not left:
                return
            if time.monotonic() > deadline:
                raise EngineError(f"{left} request(s) still unanswered {timeout_s:.0f} s after pausing {what}")
        cut_again()


class WeightValidationError(EngineError):
    """Staged weights do not fit the live model; names the tensor."""

    def __init__(self, tensor: str, reason: str) -> None:
        super().__init__(f"tensor {tensor!r}: {reason}")
        self.tensor = tensor
        self.reason = reason


@dataclass(frozen=True)
class EngineCapabilities:
    name: str  # "torch" | "vllm" | "sglang"
    sleep_levels: tuple[int, ...]  # () when the engine cannot sleep (vLLM on CPU)
    prefix_cache: bool
    logprob_mode: Literal["raw", "processed"]  # the mode of every sample, unless the request chooses it:
    logprob_mode_per_request: bool = False  # the engine reports logprobs in the request's sampling.logprob_mode
    interruptible: bool = False
    streams_samples: bool = False  # generate() takes on_sample and calls it as each sample ends


@dataclass(frozen=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]  # one per generated token, in the engine's logprob mode
    finish_reason: Literal["stop", "length", "abort"]
    # interruptible generation only: (first token index, policy version, weights digest) at every version change,
    # starting with (0, version at start, digest at start); empty when the sample ran on one version
    spans: tuple[tuple[int, int, str], ...] = ()


@dataclass(frozen=True)
class GroupOutput:
    samples: list[SampleOutput]
    policy_version: int
    weights_digest: str
    cache_generation: int
    graph_generation: int
    prefill_tokens_computed: int = 0  # prompt tokens actually run through the model for this group
    prefill_tokens_saved: int = 0  # prompt tokens served from the prefix cache instead


@dataclass(frozen=True)
class SleepReport:
    level: int
    bytes_before: int
    bytes_after: int
    verified: bool  # True when measured memory dropped by what the level promises

    @property
    def bytes_freed(self) -> int:
        return self.bytes_before - self.bytes_after


@dataclass(frozen=True)
class WakeReport:
    tags: tuple[str, ...]
    bytes_restored: int


@dataclass(frozen=True)
class CommitReport:
    policy_version: int
    weights_digest: str
    cache_generation: int
    graph_generation: int
    graphs_invalidated: bool  # False when the new shapes were proven identical


@dataclass(frozen=True)
class HealthReport:
    ok: bool
    detail: str
    probe_digest: str = ""  # digest of the probe's greedy tokens/logits, comparable across ranks
    # where a speculative draft runs (else None): its acceptance over the probe on the new weights, and over what the
    # rank served between its previous probe and the commit (workers/engines/spec_counters.py)
    spec_acceptance_rate: float | None = None
    spec_acceptance_before: float | None = None


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # manifest dtype name, e.g. "bfloat16"


@runtime_checkable
class Engine(Protocol):
    """One inference rank. Methods are synchronous; a worker runs them on its own thread."""

    @property
    def capabilities(self) -> EngineCapabilities: ...

    @property
    def policy_version(self) -> int: ...

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        n: int,
        sampling: SamplingParams,
        *,
        should_cancel: Callable[[int], bool] | None = None,
        expect_version: int | None = None,
    ) -> GroupOutput:
        """N samples sharing the prompt; the prompt is prefilled once when the engine has a prefix cache.

        `should_cancel(i)` is polled between decode steps; a cancelled sample ends with finish_reason "abort".
        An engine that streams (capabilities.streams_samples) also takes `on_sample(i, SampleOutput)`, called as
        each sample ends, so a first-k group can complete and cancel the rest while they still run.
        Raises IllegalEngineOrder while paused or asleep, and StaleRequest when `expect_version` is given and another
        version serves as the engine takes the request. A request it takes starts on the version it was taken on
        (or, where it waits for a batch meanwhile, says that version in an empty first span).
        """
        ...

    def pause(self, mode: PauseMode) -> None: ...

    def resume(self) -> None: ...

    @property
    def is_paused(self) -> bool: ...

    def sleep(self, level: int) -> SleepReport: ...

    def wake(self, tags: Sequence[WakeTag]) -> WakeReport: ...

    @property
    def asleep_level(self) -> int:
        """0 when awake (or woken by every tag)."""
        ...

    def kv_cache_tokens(self) -> int | None:
        """How many tokens the engine's KV cache holds, where the engine reports it (None: unbounded or unknown). A
        rank keeps the worst case of the groups it runs at once within `kv_cache_cap` of it (workers/roles/rollout.py)."""
        ...

    def live_tensor_specs(self) -> Mapping[str, TensorSpec]:
        """Name -> shape/dtype of the live weights, what staged tensors are validated against."""
        ...

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> str:
        """Validate shapes/dtypes against the live model, copy into an inactive buffer; return its digest.

        Raises WeightValidationError naming the tensor; the live weights are untouched either way.
        """
        ...

    def commit_weights(self, version: int) -> CommitReport:
        """Swap the staged buffer in, invalidate the prefix/KV cache (new generation) and graphs unless shapes are
        identical. Refused (IllegalEngineOrder) while asleep or with nothing staged."""
        ...

    def prepare(self, version: int, uri: str, manifest: WeightManifest) -> str:
        """Read the update staged at `uri`, verify every checksum against `manifest`, and stage it (as
        `stage_weights`); return the staged digest. The one prepare path of every engine: an in-process engine
        loads through `workers.weights.staging_loader.load_verified`, a remote one makes its own workers read the files.

        Raises StagingError (unreadable, truncated, checksum mismatch naming the tensor), WeightValidationError
        or IllegalEngineOrder (asleep); the live weights keep serving either way.
        """
        ...

    @property
    def cache_generation(self) -> int:
        """Generation of the prefix/KV cache: bumped each time it is invalidated."""
        ...

    @property
    def graph_generation(self) -> int:
        """Generation of the captured graphs: bumped when a commit changed shapes."""
        ...

    def discard_weights(self) -> None: ...

    def reset_prefix_cache(self) -> int:
        """Drop cached prefixes; returns the new cache generation."""
        ...

    def weights_digest(self) -> str:
        """workers.weights.tensors.state_digest of the live weights."""
        ...

    def health(self) -> HealthReport:
        """A forward pass on a fixed probe; fails on NaN/inf or an engine error."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ArmsFaults(Protocol):
    """An engine whose faults must be armed where it reads the staged files (a remote server's workers)."""

    def inject(self, spec: str) -> None: ...


@dataclass
class EngineStats:
    """Counters an engine keeps for telemetry and benchmarks."""

    groups: int = 0
    generated_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefill_tokens_saved: int = 0
    cancelled_samples: int = 0  # samples cut short in the engine (first k reached, group closed): their slots freed
    cancelled_tokens: int = 0  # the tokens those samples had generated (work the cancel wasted)
    extra: dict[str, float] = field(default_factory=dict)
