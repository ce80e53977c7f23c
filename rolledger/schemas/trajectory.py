"""The trajectory: one sample with everything needed to train on it and to explain where it came from."""

from __future__ import annotations

import functools
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from rolledger.schemas.base import F32, I8, I32, Float32Array, Int8Array, Int32Array, Record, packed
from rolledger.schemas.config import SamplingParams
from rolledger.schemas.wire import encoded_size

NonNegative = Annotated[int, Meta(ge=0)]


def trajectory_nbytes(prompt_tokens: int, generated_tokens: int) -> int:
    """The bytes a log written before `SampleFinished.nbytes` counted for a queued trajectory: its arrays (int32
    prompt ids; per generated token an int32 id, int32 position, float32 logprob, int8 mask) plus 256. Such a log is
    replayed and audited by this formula; a newer one records every trajectory's encoded size."""
    return 4 * prompt_tokens + 13 * generated_tokens + 256


SPANS_RESERVED = 8  # version spans a sample of an interruptible run may carry within its reservation
_WALL = 4102444800.123456  # a wall time (a float64 packs to 9 bytes whatever its value)
_WIDE_INT = 2**32 - 1  # the widest integer a trajectory field is reserved for (5 bytes of msgpack)
_DIGEST = "f" * 64  # the longest weights digest reserved for (a sha256 in hex)
_ENGINE = "e" * 32  # the longest engine name reserved for


def reserved_nbytes(
    group_id: str,
    prompt_id: str,
    prompt_tokens: int,
    n: int,
    sampling: SamplingParams,
    spans: int,
    *,
    width: int | None = None,
    turns: int = 0,
) -> int:
    """The encoded size of the largest trajectory a sample of this group can finish with, within its reservation:
    every array at `width` tokens (`sampling.max_tokens` unless given: an episode's token budget), the widest
    integers (seed included), digest and engine name, `spans` version spans and `turns` episode turns. Admission
    reserves it per sample; a rank whose sample encodes larger fails it rather than let the queue overrun its byte
    cap. An encoded size depends on the lengths of the strings and arrays, not their contents: it is computed once
    per shape."""
    if sampling.seed is not None and sampling.seed < _WIDE_INT:
        sampling = sampling.model_copy(update={"seed": _WIDE_INT})
    width = sampling.max_tokens if width is None else width
    return _reserved_nbytes(
        len(group_id.encode()), len(prompt_id.encode()), prompt_tokens, n, sampling, spans, width, turns
    )


@functools.lru_cache(maxsize=256)
def _reserved_nbytes(
    group_id_len: int,
    prompt_id_len: int,
    prompt_tokens: int,
    n: int,
    sampling: SamplingParams,
    spans: int,
    width: int,
    turns: int,
) -> int:
    group_id = "g" * group_id_len
    # the arrays zero-filled at full width
    fields: dict[str, Any] = {
        "trajectory_id": f"{group_id}/{n - 1}",
        "group_id": group_id,
        "prompt_id": "p" * prompt_id_len,
        "index": n - 1,
        "prompt_token_ids": bytes(4 * prompt_tokens),
        "token_ids": bytes(4 * width),
        "loss_mask": bytes(width),
        "positions": bytes(4 * width),
        "logprobs": bytes(4 * width),
        "logprob_mode": "processed",
        "finish_reason": "length",
        "sampling": sampling,
        "policy_version": _WIDE_INT,
        "weights_digest": _DIGEST,
        "rank": _WIDE_INT,
        "engine": _ENGINE,
        "cache_generation": _WIDE_INT,
        "graph_generation": _WIDE_INT,
        "spans": tuple(
            VersionSpan(start=_WIDE_INT, end=_WIDE_INT, policy_version=_WIDE_INT, weights_digest=_DIGEST)
            for _ in range(spans)
        ),
        "turns": tuple(
            Turn(start=_WIDE_INT, end=_WIDE_INT, source="policy", began=_WALL, ended=_WALL) for _ in range(turns)
        ),
    }
    return encoded_size(Trajectory(**fields))


class VersionSpan(Record, frozen=True, kw_only=True):
    """Output tokens [start, end) generated under `policy_version` (interruptible generation stamps each span)."""

    start: NonNegative
    end: NonNegative
    policy_version: NonNegative
    weights_digest: str


class Turn(Record, frozen=True, kw_only=True):
    """One turn of an episode (a task with an environment, issue 40): generated tokens [start, end) came from
    `source`, "policy" (the engine generated them: loss mask 1, their logprobs, a version span) or "env" (the
    environment's reply: loss mask 0, logprob 0, never trained on), between the wall times `began` (the engine
    request or the environment call was made) and `ended` (it returned). An episode's turns alternate, start with the
    policy and cover its generated tokens in order with no gap (the audit checks it, workflows/episode.py)."""

    start: NonNegative
    end: NonNegative
    source: Literal["policy", "env"]
    began: float
    ended: float


_ARRAYS = (
    ("prompt_token_ids", Int32Array),
    ("token_ids", Int32Array),
    ("loss_mask", Int8Array),
    ("positions", Int32Array),
    ("logprobs", Float32Array),
)
_force = msgspec.structs.force_setattr


class Trajectory(Record, frozen=True, kw_only=True):
    """One sample: tokens, masks, positions, logprobs and their mode, and the provenance of every token.

    The arrays are packed (schemas.base): given as lists, tuples, bytes, numpy arrays or tensors, they are stored as
    one machine buffer each. Per generated token: `token_ids`, `loss_mask` (1 where trained on), `positions`,
    `logprobs` (in `logprob_mode`); all four have the same length (checked where it is built or decoded).

    `turns`: empty for a single completion; for an episode (a task with an environment) the turns its tokens came
    from, the policy's and the environment's (`Turn`). An empty `turns` is left out of the map form (schemas/wire),
    so a single-turn trajectory's accounting size is what it was before episodes."""

    trajectory_id: str
    group_id: str
    prompt_id: str
    index: NonNegative  # sample index within its group
    prompt_token_ids: I32
    token_ids: I32
    loss_mask: I8
    positions: I32
    logprobs: F32
    logprob_mode: Literal["raw", "processed"]
    finish_reason: Literal["stop", "length", "abort"]
    sampling: SamplingParams
    policy_version: NonNegative
    weights_digest: str
    rank: NonNegative
    engine: str
    cache_generation: NonNegative
    graph_generation: NonNegative
    spans: tuple[VersionSpan, ...] = ()
    turns: tuple[Turn, ...] = ()

    # fields the map form (the accounting size, schemas/wire.encoded_size) leaves out while empty: added after the
    # size was defined, so every trajectory without them counts as it did when it was recorded
    MAP_OMIT_EMPTY: ClassVar[tuple[str, ...]] = ("turns",)

    def __post_init__(self) -> None:
        for name, cls in _ARRAYS:
            value = getattr(self, name)
            if type(value) is not cls:
                _force(self, name, packed(cls, value, name))
        n = len(self.token_ids)
        for name in ("loss_mask", "positions", "logprobs"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} generated tokens")
        if type(self.spans) is not tuple:
            _force(self, "spans", tuple(self.spans))
        if type(self.turns) is not tuple:
            _force(self, "turns", tuple(self.turns))
        if type(self.sampling) is dict:  # built in code from a mapping, as pydantic accepted it
            _force(self, "sampling", SamplingParams(**self.sampling))
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling: expected SamplingParams, got {type(self.sampling).__name__}")

    @property
    def versions(self) -> set[int]:
        """Every policy version that produced a token of this sample."""
        return {s.policy_version for s in self.spans} or {self.policy_version}

    @property
    def is_episode(self) -> bool:
        """Its tokens came from turns of the policy and an environment (a task with an environment)."""
        return bool(self.turns)

    @property
    def legacy_nbytes(self) -> int:
        """What a log written before `SampleFinished.nbytes` counted for this trajectory (`trajectory_nbytes`)."""
        return trajectory_nbytes(len(self.prompt_token_ids), len(self.token_ids))
