"""The trajectory: one sample with everything needed to train on it and to explain where it came from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rolledger.schemas.base import F32Array, I8Array, I32Array, Model
from rolledger.schemas.config import SamplingParams


def trajectory_nbytes(prompt_tokens: int, generated_tokens: int) -> int:
    """Bytes a queued trajectory holds: int32 prompt ids; per generated token an int32 id, int32 position, float32
    logprob and int8 mask; plus a fixed overhead. The one formula admission, completion and the trainer share."""
    return 4 * prompt_tokens + 13 * generated_tokens + 256


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
    def nbytes(self) -> int:
        """Approximate bytes this trajectory holds while queued (token ids, masks, positions, logprobs)."""
        return trajectory_nbytes(len(self.prompt_token_ids), len(self.token_ids))
