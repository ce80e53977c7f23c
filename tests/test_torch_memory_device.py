"""workers/engines/torch_memory.device_used_bytes: the device's own figure (torch.cuda.mem_get_info) a colocated
release is measured by. On CPU there is none (None); on CUDA a released parameter set must show on the device, and
retaking it must too (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from rolledger.workers.engines import torch_memory


def test_a_cpu_device_has_no_device_figure() -> None:
    assert torch_memory.device_used_bytes(torch.device("cpu")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mem_get_info needs a CUDA device (none here)")
def test_a_release_and_a_restore_show_on_the_device() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    params = {f"w{i}": torch.nn.Parameter(torch.ones(64 << 20, dtype=torch.uint8, device=device)) for i in range(4)}
    host = torch_memory.host_copy_of(params, device)
    torch.cuda.synchronize()
    before = torch_memory.device_used_bytes(device)
    torch_memory.release(params, device)
    torch.cuda.empty_cache()  # what the engine does after a release: the allocator's cache goes back to the device
    released = torch_memory.device_used_bytes(device)
    assert before is not None and released is not None
    assert before - released >= 0.9 * (256 << 20)
    torch_memory.restore(params, host, {n: (64 << 20,) for n in params}, {n: torch.uint8 for n in params}, device)
    torch.cuda.synchronize()
    retaken = torch_memory.device_used_bytes(device)
    assert retaken is not None and retaken - released >= 0.9 * (256 << 20)
    assert all(bool((p.data == 1).all()) for p in params.values())
