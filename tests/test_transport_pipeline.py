"""The dist transport's pipeline (workers/weights/transport_dist*.py): `SLOTS` buckets in flight on both sides, buckets of one
piece sent from the snapshot and received into their tensor without a copy, per-bucket timings; and its CUDA paths as
far as a CPU goes. The device-bucket path NCCL takes (host bytes staged through `SLOTS` device buffers) runs here over
gloo with CPU "device" buffers; a real NCCL transfer is skipped without CUDA. Everything else is real: a WeightServer
(TCPStore + gloo) in this process, the receiver on the test's thread, every byte checked against the manifest."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from rolledger.workers.weights import transport_dist_receive, transport_dist_server
from rolledger.workers.weights.staging_format import StagingError, version_dir
from rolledger.workers.weights.staging_store import build_manifest, prepare_for_save
from rolledger.workers.weights.transport_dist import SLOTS, Wait, Wire, backend_for, chunks
from rolledger.workers.weights.transport_dist_receive import GroupCommunicator, read_manifest, receive_verified
from rolledger.workers.weights.transport_dist_server import WeightServer


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(256, 32, generator=g),  # 32 KiB: several one-piece buckets of 4000 bytes
        "layer.0.bias": torch.randn(32, generator=g).to(torch.bfloat16),
        "layer.0.weight": torch.randn(32, 32, generator=g),
        "scale": torch.tensor(1.5),
        "empty": torch.empty(0, 4),
    }


BUCKET = 4000


def _offer(server: WeightServer, root: Path, version: int, state: dict[str, torch.Tensor]) -> str:
    tensors = prepare_for_save(state, version)
    manifest = build_manifest(tensors, version, version - 1, "xxh3_128")
    dirname = version_dir(root, version, manifest.digest).name
    uri = server.offer(dirname, manifest, tensors)
    server.persisted(dirname)  # the durable copy is not what these tests are about
    return uri


def _buckets(state: dict[str, torch.Tensor]) -> int:
    return len(list(chunks([t.numel() * t.element_size() for t in state.values()], BUCKET)))


def test_every_bucket_is_pipelined_received_verified_and_timed(tmp_path: Path) -> None:
    want = _state(1)
    with WeightServer(tmp_path, bucket_bytes=BUCKET, timeout_s=60) as server:
        uri = _offer(server, tmp_path, 1, want)
        got = receive_verified(uri, 1, read_manifest(uri, 1, timeout_s=60), timeout_s=60)
        n = _buckets(want)
        assert n > 2 * SLOTS
        # the receiver timed every bucket, and the one-piece buckets (the embedding's) landed in place: no copy
        assert len(got.timings.buckets) == n
        assert sum(b.nbytes for b in got.timings.buckets) == got.manifest.total_bytes
        assert got.timings.buckets[0].in_place and got.timings.buckets[0].copy_s == 0.0
        assert not got.timings.buckets[-1].in_place  # the tails of several tensors: copied out of its slot
        assert server.transfers[-1].buckets == n
    for name, t in want.items():
        assert torch.equal(got[name], t), name


class _FlipsOnTheWireFake:
    """A communicator whose bytes arrive with one bit flipped in bucket `bad`: what a corrupting link does, after the
    receive (so it hits a bucket received in place as well as one copied out)."""

    def __init__(self, wire: Wire, bad: int) -> None:
        self.inner = GroupCommunicator(wire)
        self.bad = bad

    def irecv(self, buf: torch.Tensor, tag: int) -> Wait:
        wait = self.inner.irecv(buf, tag)
        if tag != self.bad:
            return wait

        def flipped() -> None:
            wait()
            buf[len(buf) // 2] ^= 1

        return flipped


@pytest.mark.parametrize(("bad", "tensor"), [(1, "embed.weight"), ("last", "layer.0.weight")])
def test_a_corrupt_bucket_names_its_tensor(tmp_path: Path, bad: int | str, tensor: str) -> None:
    """Bucket 1 is the middle of the embedding (received in place); the last bucket holds the tail of several tensors
    (copied out of its slot): either way the checksum catches it and the error names the tensor."""
    want = _state(2)
    last = _buckets(want) - 1
    tag = last if bad == "last" else int(bad)
    with WeightServer(tmp_path, bucket_bytes=BUCKET, timeout_s=30) as server:
        uri = _offer(server, tmp_path, 1, want)
        manifest = read_manifest(uri, 1, timeout_s=30)
        pieces = list(chunks([e.nbytes for e in manifest.tensors], BUCKET))[tag]
        flipped_at = sum(p[2] for p in pieces) // 2  # which tensor the flipped byte belongs to
        for i, _, length in pieces:
            if flipped_at < length:
                assert manifest.tensors[i].name == tensor
                break
            flipped_at -= length

        def corrupting(wire: Wire) -> _FlipsOnTheWireFake:
            return _FlipsOnTheWireFake(wire, tag)

        with pytest.raises(StagingError) as e:
            receive_verified(uri, 1, manifest, timeout_s=30, communicator=corrupting)  # type: ignore[arg-type]
    assert e.value.kind == "checksum"
    assert e.value.tensor == tensor


def test_the_device_bucket_path_moves_every_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL's path with the device being the CPU: each side stages its buckets through `SLOTS` buffers of its own
    (copy in before a send, out after a receive), slots reused in turn; the result is still verified byte for byte."""
    for side in (transport_dist_server, transport_dist_receive):  # each side asks where its buckets go
        monkeypatch.setattr(side, "wire_device", lambda backend: torch.device("cpu"))
    want = _state(3)
    with WeightServer(tmp_path, bucket_bytes=BUCKET, timeout_s=60) as server:
        uri = _offer(server, tmp_path, 1, want)
        out = {k: torch.zeros_like(v) for k, v in want.items()}
        got = receive_verified(uri, 1, read_manifest(uri, 1, timeout_s=60), timeout_s=60, out=out)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
        assert got[name].data_ptr() == out[name].data_ptr() or t.numel() == 0, name


def test_the_backend_follows_the_device() -> None:
    assert backend_for("cpu") == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"  # a decision on the device type: no GPU needed
    assert backend_for("meta") == "gloo"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device")
def test_nccl_is_refused_in_one_line_without_cuda(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a CUDA device") as e:
        WeightServer(tmp_path, backend="nccl")
    assert "\n" not in str(e.value)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.distributed.is_nccl_available() and torch.cuda.device_count() >= 2),
    reason="a real NCCL transfer needs two CUDA devices (NCCL refuses two members on one) and NCCL (none here)",
)
def test_an_nccl_transfer_is_verified_against_its_manifest(tmp_path: Path) -> None:
    """The server's member on device 0, the receiver's on device 1 (its thread's current device): the same protocol
    as gloo through device buckets."""
    want = _state(4)
    with WeightServer(tmp_path, bucket_bytes=BUCKET, timeout_s=60, backend="nccl") as server:
        uri = _offer(server, tmp_path, 1, want)
        got: dict[str, torch.Tensor] = {}

        def receive() -> None:
            torch.cuda.set_device(1)
            got.update(receive_verified(uri, 1, read_manifest(uri, 1, timeout_s=60), timeout_s=60))

        receiver = threading.Thread(target=receive)
        receiver.start()
        receiver.join(120)
        assert not receiver.is_alive()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
