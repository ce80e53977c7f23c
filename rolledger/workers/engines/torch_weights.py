"""The torch engine's weight buffers: validating an update, staging it into an inactive buffer, copying it live.

`validate_update` checks a candidate state dict against the live model's tensor specs (every name present, no
stranger, same shape and dtype, finite), raising WeightValidationError naming the tensor; `stage_buffer` copies it
onto the engine's device and digests it (the live weights keep serving meanwhile); `copy_into` swaps a staged buffer
into the live parameters at commit. The engine (workers.engines.torch_engine) decides when each may happen.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from rolledger.workers.engines.protocol import TensorSpec, WeightValidationError
from rolledger.workers.weights.tensors import dtype_name, state_digest


@dataclass
class StagedWeights:
    version: int
    tensors: dict[str, torch.Tensor]
    digest: str


def validate_update(specs: Mapping[str, TensorSpec], tensors: Mapping[str, torch.Tensor]) -> None:
    """WeightValidationError naming the first tensor of `tensors` that cannot replace the live one of `specs`."""
    for name, t in tensors.items():
        spec = specs.get(name)
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
    missing = sorted(set(specs) - set(tensors))
    if missing:
        raise WeightValidationError(missing[0], f"missing from the staged weights ({len(missing)} missing)")


def stage_buffer(version: int, tensors: Mapping[str, torch.Tensor], device: torch.device) -> StagedWeights:
    """A private copy of `tensors` on `device`, with its state digest."""
    buffer = {name: t.detach().to(device, copy=True) for name, t in tensors.items()}
    return StagedWeights(version=version, tensors=buffer, digest=state_digest(buffer))


def copy_into(params: Mapping[str, torch.nn.Parameter], staged: StagedWeights) -> bool:
    """Make the staged tensors live; True when every shape matched (copied in place, graphs stay valid)."""
    same_shapes = all(tuple(p.shape) == tuple(staged.tensors[n].shape) for n, p in params.items())
    for name, p in params.items():
        if same_shapes:
            p.data.copy_(staged.tensors[name])
        else:  # never reached after validation; kept so a shape change is handled honestly
            p.data = staged.tensors[name]
    return same_shapes
