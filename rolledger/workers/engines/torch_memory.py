"""The torch engine's memory accounting for sleep/wake: what its live parameters hold, and moving it out and back.

Level 1 offloads the weights to a host copy (on a CPU device the host copy *is* the old storage: ownership moves,
no bytes are copied; on CUDA it is pinned); level 2 drops them. Either way every live parameter's storage is
replaced by an empty tensor, so the accounted bytes go to 0. Waking restores the host copy, or reallocates each
parameter uninitialised (level 2: garbage until new weights are committed). The engine (workers.engines.torch_engine)
decides when; it holds the model lock around every call here.

On CUDA what the accounting says is checked against the device itself: `device_used_bytes` is what
`torch.cuda.mem_get_info` says is taken on the device (by every process on it), so a release measured that way counts
only memory the caching allocator really gave back (the engine empties its cache after a release), and a wake the
memory really retaken. `bench/gpu_check.py` measures a sleep -> train -> wake cycle with it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def device_used_bytes(device: torch.device) -> int | None:
    """Bytes taken on a CUDA device per the driver (`torch.cuda.mem_get_info`: total less free, every process's);
    None on any other device, where there is no such figure."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def param_bytes(params: Mapping[str, torch.nn.Parameter]) -> int:
    """Bytes of live parameter storage, each shared storage (tied weights) counted once."""
    seen: set[int] = set()
    total = 0
    for p in params.values():
        storage = p.data.untyped_storage()
        if storage.data_ptr() in seen and storage.nbytes() > 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def host_bytes(host_copy: Mapping[str, torch.Tensor] | None) -> int:
    """Bytes of a level-1 host copy (0 when there is none)."""
    return sum(storage_nbytes(t) for t in host_copy.values()) if host_copy else 0


def host_copy_of(params: Mapping[str, torch.nn.Parameter], device: torch.device) -> dict[str, torch.Tensor]:
    """The level-1 host copy of the live parameters (their own storage on a CPU device, pinned on CUDA)."""
    on_cpu = device.type == "cpu"
    pin = torch.cuda.is_available() and not on_cpu
    return {
        n: (p.data if on_cpu else p.data.to("cpu", copy=True).pin_memory() if pin else p.data.cpu())
        for n, p in params.items()
    }


def release(params: Mapping[str, torch.nn.Parameter], device: torch.device) -> None:
    """Replace every live parameter's storage with an empty tensor."""
    for p in params.values():
        p.data = torch.empty(0, dtype=p.dtype, device=device)


def restore(
    params: Mapping[str, torch.nn.Parameter],
    host_copy: Mapping[str, torch.Tensor] | None,
    shapes: Mapping[str, tuple[int, ...]],
    dtypes: Mapping[str, torch.dtype],
    device: torch.device,
) -> None:
    """Bring the host copy back onto `device`, or (no host copy) reallocate each parameter uninitialised."""
    for name, p in params.items():
        if host_copy is not None:
            p.data = host_copy[name].to(device)
        else:
            p.data = torch.empty(shapes[name], dtype=dtypes[name], device=device)
