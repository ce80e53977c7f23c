"""The trajectory: one sample with everything needed to train on it and to explain where it came from."""

from __future__ import annotations

import array
import functools
from typing import Any, Literal

from pydantic import Field, model_validator

from rolledger.schemas.base import F32Array, I8Array, I32Array, Model
from rolledger.schemas.config import SamplingParams
from rolledger.schemas.wire import encoded_size


def trajectory_nbytes(prompt_tokens: int, generated_tokens: int) -> int:
    """The bytes a log written before `SampleFinished.nbytes` counted for a queued trajectory: its arrays (int32
    prompt ids; per generated token an int32 id, int32 position, float32 logprob, int8 mask) plus 256. Such a log is
    replayed and audited by this formula; a newer one records every trajectory's encoded size."""
    return 4 * prompt_tokens + 13 * generated_tokens + 256


SPANS_RESERVED = 8  # version spans a sample of an interruptible run may carry within its reservation
_WIDE_INT = 2**32 - 1  # the widest integer a trajectory field is reserved for (5 bytes of msgpack)
_DIGEST = "f" * 64  # the longest weights digest reserved for (a sha256 in hex)
_ENGINE = "e" * 32  # the longest engine name reserved for


def reserved_nbytes(
    group_id: str, prompt_id: str, prompt_tokens: int, n: int, sampling: SamplingParams, spans: int
) -> int:
    """The encoded size of the largest trajectory a sample of this group can finish with, within its reservation:
    every array at `sampling.max_tokens`, the widest integers (seed included), digest and engine name, and `spans`
    version spans. Admission reserves it per sample; a rank whose sample encodes larger fails it rather than let the
    queue overrun its byte cap. An encoded size depends on the lengths of the strings and arrays, not their contents:
    it is computed once per shape."""
    if sampling.seed is not None and sampling.seed < _WIDE_INT:
        sampling = sampling.model_copy(update={"seed": _WIDE_INT})
    return _reserved_nbytes(len(group_id.encode()), len(prompt_id.encode()), prompt_tokens, n, sampling, spans)


@functools.lru_cache(maxsize=256)
def _reserved_nbytes(
    group_id_len: int, prompt_id_len: int, prompt_tokens: int, n: int, sampling: SamplingParams, spans: int
) -> int:
    width = sampling.max_tokens
    group_id = "g" * group_id_len
    # built without validation (every value is valid by construction), the arrays as zero-filled machine arrays
    fields: dict[str, Any] = {
        "trajectory_id": f"{group_id}/{n - 1}",
        "group_id": group_id,
        "prompt_id": "p" * prompt_id_len,
        "index": n - 1,
        "prompt_token_ids": array.array("i", bytes(4 * prompt_tokens)),
        "token_ids": array.array("i", bytes(4 * width)),
        "loss_mask": array.array("b", bytes(width)),
        "positions": array.array("i", bytes(4 * width)),
        "logprobs": array.array("f", bytes(4 * width)),
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
    }
    worst = Trajectory.model_construct(**fields)
    return encoded_size(worst)


class VersionSpan(Model):
    """Output tokens [start, end) generated under `policy_version` (interruptible generation stamps each span)."""

    start: int = Field(ge=0)
    end: int = Field(ge=0)
    policy_version: int = Field(ge=0)
    weights_digest: str


class Trajectory(Model):
    """One sample: tokens, masks, positions, logprobs and their mode, and the provenance of every token."""

    trajectory_id: str
    group_id: str
    prompt_id: str
    index: int = Field(ge=0, description="sample index within its group")
    prompt_token_ids: I32Array
    token_ids: I32Array = Field(description="generated tokens")
    loss_mask: I8Array = Field(description="1 where the token is trained on, per generated token")
    positions: I32Array = Field(description="position id of each generated token")
    logprobs: F32Array = Field(description="per generated token, in logprob_mode")
    logprob_mode: Literal["raw", "processed"]
    finish_reason: Literal["stop", "length", "abort"]
    sampling: SamplingParams
    policy_version: int = Field(ge=0)
    weights_digest: str
    rank: int = Field(ge=0)
    engine: str
    cache_generation: int = Field(ge=0)
    graph_generation: int = Field(ge=0)
    spans: tuple[VersionSpan, ...] = ()

    @model_validator(mode="after")
    def _aligned(self) -> Trajectory:
        n = len(self.token_ids)
        for name in ("loss_mask", "positions", "logprobs"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} generated tokens")
        return self

    @property
    def versions(self) -> set[int]:
        """Every policy version that produced a token of this sample."""
        return {s.policy_version for s in self.spans} or {self.policy_version}

    @property
    def legacy_nbytes(self) -> int:
        """What a log written before `SampleFinished.nbytes` counted for this trajectory (`trajectory_nbytes`)."""
        return trajectory_nbytes(len(self.prompt_token_ids), len(self.token_ids))
