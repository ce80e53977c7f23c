"""The torch.distributed weight transport on its own: a real WeightServer (TCPStore + gloo) in this process, receivers
on threads, the real directory store as the trainer's copy. What a rank receives is verified byte for byte against
the manifest, so a transport that moves nothing, stops short or sends another version is a StagingError naming the
tensor; a receiver that dies mid-transfer ends only its own session."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from rolledger.workers.weights import transport_dist_receive
from rolledger.workers.weights.staging_format import StagingError
from rolledger.workers.weights.staging_loader import VerifiedWeights
from rolledger.workers.weights.staging_store import DirectoryStagingStore, StagedUpdate
from rolledger.workers.weights.transport_dist import DEFAULT_TIMEOUT_S, DistAddress, Wait, dist_uri, parse_uri
from rolledger.workers.weights.transport_dist_delta import DeltaBase
from rolledger.workers.weights.transport_dist_receive import (
    GroupCommunicator,
    NoOpCommunicatorFake,
    read_manifest,
    receive_verified,
)
from rolledger.workers.weights.transport_dist_server import WeightServer


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g),
        "layer.0.bias": torch.randn(32, generator=g).to(torch.bfloat16),
        "layer.0.weight": torch.randn(32, 32, generator=g),
        "scale": torch.tensor(1.5),
        "empty": torch.empty(0, 4),
    }


@pytest.fixture
def staged(tmp_path: Path) -> tuple[DirectoryStagingStore, StagedUpdate, StagedUpdate, dict[str, torch.Tensor]]:
    store = DirectoryStagingStore(tmp_path / "trainer-staging", fsync=False)
    v1 = store.stage(1, 0, _state(1))
    want = _state(2)
    v2 = store.stage(2, 1, want)
    return store, v1, v2, want


def _dirname(u: StagedUpdate) -> str:
    return Path(u.uri.removeprefix("file://")).name


# small buckets: tensors span buckets and buckets hold several tensors
@pytest.mark.parametrize("bucket_bytes", [1000, 1 << 20])
def test_a_rank_receives_every_byte_verified(staged, bucket_bytes: int) -> None:
    store, _, v2, want = staged
    with WeightServer(store.root, bucket_bytes=bucket_bytes, timeout_s=60) as server:
        uri = server.uri(_dirname(v2))
        manifest = read_manifest(uri, 2, expected_digest=v2.manifest_digest, timeout_s=60)
        got = receive_verified(uri, 2, manifest, timeout_s=60)
    assert list(got) == list(manifest.names)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    assert got.manifest_digest == v2.manifest_digest


def test_into_the_ranks_own_buffers(staged) -> None:
    store, _, v2, want = staged
    out = {k: torch.zeros_like(v) for k, v in want.items()}
    with WeightServer(store.root, timeout_s=60) as server:
        uri = server.uri(_dirname(v2))
        got = receive_verified(uri, 2, read_manifest(uri, 2, timeout_s=60), out=out, timeout_s=60)
    assert all(got[k] is out[k] for k in out)
    assert torch.equal(out["layer.0.weight"], want["layer.0.weight"])


def test_several_receivers_at_once_each_get_the_version(staged) -> None:
    store, _, v2, want = staged
    results: list[object] = []
    with WeightServer(store.root, bucket_bytes=4096, timeout_s=60) as server:
        uri = server.uri(_dirname(v2))
        manifest = read_manifest(uri, 2, timeout_s=60)

        def fetch() -> None:
            try:
                results.append(receive_verified(uri, 2, manifest, timeout_s=60))
            except Exception as e:  # noqa: BLE001 - reported below
                results.append(e)

        threads = [threading.Thread(target=fetch) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert len(results) == 3
    for r in results:
        assert isinstance(r, VerifiedWeights), r
        assert torch.equal(r["embed.weight"], want["embed.weight"])


def _ends_the_abandoned_send_at_once(server: WeightServer) -> None:
    """The receiver gave up while the server was sending it a bucket: its side of the group is torn down, so the
    server's send fails on the closed connection and closing the server does not wait out the transfer's deadline."""
    t0 = time.monotonic()
    server.close()
    assert time.monotonic() - t0 < server.timeout_s / 2
    assert len(server.failed) == 1 and "Timed out" not in server.failed[0], server.failed  # closed or reset by peer


def test_a_communicator_that_moves_nothing_is_caught_naming_the_tensor(staged) -> None:
    store, _, v2, _ = staged
    with WeightServer(store.root, timeout_s=60) as server:
        uri = server.uri(_dirname(v2))
        manifest = read_manifest(uri, 2, timeout_s=60)
        # zeroed buffers: fresh ones are uninitialised, and the allocator may hand back memory that held these very
        # bytes (an earlier copy of v2, freed), which a transfer moving nothing would then leave right
        out = {t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in manifest.tensors}
        with pytest.raises(StagingError) as e:
            receive_verified(uri, 2, manifest, timeout_s=60, communicator=NoOpCommunicatorFake, out=out)
        _ends_the_abandoned_send_at_once(server)
    assert e.value.kind == "checksum"
    assert e.value.tensor == manifest.tensors[0].name
    assert "after the transfer" in str(e.value)


def test_a_byte_flipped_in_transit_names_the_tensor(staged) -> None:
    store, _, v2, _ = staged
    with WeightServer(store.root, bucket_bytes=1000, timeout_s=60) as server:
        uri = server.uri(_dirname(v2))
        manifest = read_manifest(uri, 2, timeout_s=60)
        with pytest.raises(StagingError) as e:
            receive_verified(uri, 2, manifest, timeout_s=60, corrupt="layer.0.weight")
    assert (e.value.kind, e.value.tensor) == ("checksum", "layer.0.weight")


def test_the_bytes_of_another_version_are_caught(staged) -> None:
    """The server sends version 1's bytes under version 2's manifest (the wrong buffer): every changed tensor fails."""
    store, v1, v2, _ = staged
    with WeightServer(store.root, timeout_s=60) as server:
        m2 = read_manifest(server.uri(_dirname(v2)), 2, timeout_s=60)
        wrong = server.uri(_dirname(v1)).replace("v000001", "v000002")  # v1's directory under v2's name
        with pytest.raises(StagingError) as e:
            receive_verified(wrong, 2, m2, timeout_s=60)
    assert e.value.kind == "not_found"  # the server checks the digest the rank asks for against what it holds


def test_manifest_not_the_announced_digest(staged) -> None:
    store, _, v2, _ = staged
    with WeightServer(store.root, timeout_s=60) as server, pytest.raises(StagingError) as e:
        read_manifest(server.uri(_dirname(v2)), 2, expected_digest="0" * 32, timeout_s=60)
    assert e.value.kind == "manifest"


def test_a_version_the_server_does_not_have(staged) -> None:
    store, _, _v2, _ = staged
    with WeightServer(store.root, timeout_s=60) as server, pytest.raises(StagingError) as e:
        read_manifest(server.uri("v000009-000000000000"), 9, timeout_s=60)
    assert e.value.kind == "not_found"


def test_a_server_that_is_gone_fails_the_transfer_at_once_not_at_the_deadline(
    staged, monkeypatch: pytest.MonkeyPatch
) -> None:
    """c10d retries a refused connection until its timeout; a rank would sit out the whole deadline (and miss the
    run's end) waiting for a trainer that died. The receiver connects with a short deadline of its own first (10 s;
    1 s here, so the test does not sit out the 10 s either: what is checked is that the URI's 120 s are not taken)."""
    monkeypatch.setattr(transport_dist_receive, "CONNECT_TIMEOUT_S", 1.0)
    _, _, v2, _ = staged
    server = WeightServer(staged[0].root, timeout_s=120)
    uri = server.uri(_dirname(v2))
    manifest = read_manifest(uri, 2)
    port = server.port
    server.close()
    del server  # the TCPStore server goes with its last reference
    import gc
    import socket
    import time

    gc.collect()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "the server still listens"
    t0 = time.monotonic()
    with pytest.raises(StagingError) as e:
        receive_verified(uri, 2, manifest)
    assert e.value.kind == "transport" and "unreachable" in str(e.value)
    assert time.monotonic() - t0 < 60  # the URI's deadline is 120 s (the connect's, 1 s)


class _DiesAfterFirstBucket:
    """A receiver whose process dies after the first bucket: it stops receiving and its group goes away."""

    def __init__(self, wire) -> None:
        self.inner = GroupCommunicator(wire)
        self.n = 0

    def irecv(self, buf: torch.Tensor, tag: int) -> Wait:
        self.n += 1
        if self.n == 1:
            return self.inner.irecv(buf, tag)

        def killed() -> None:  # the second bucket never lands: the process died waiting for it
            raise RuntimeError("receiver killed mid-transfer")

        return killed


def test_a_receiver_dying_mid_transfer_ends_only_its_session(staged) -> None:
    store, _, v2, want = staged
    with WeightServer(store.root, bucket_bytes=1000, timeout_s=30) as server:
        uri = server.uri(_dirname(v2))
        manifest = read_manifest(uri, 2, timeout_s=30)
        with pytest.raises(StagingError) as e:
            receive_verified(uri, 2, manifest, timeout_s=30, communicator=_DiesAfterFirstBucket)  # type: ignore[arg-type]
        assert e.value.kind == "transport"
        got = receive_verified(uri, 2, manifest, timeout_s=60)  # the next transfer: a fresh group
        assert torch.equal(got["embed.weight"], want["embed.weight"])
        _ends_the_abandoned_send_at_once(server)
    assert len(server.served) == 1


def test_uri_round_trip_and_refusals() -> None:
    uri = dist_uri("127.0.0.1", 29511, "v000007-0123456789ab")
    assert uri == "dist://127.0.0.1:29511/v000007-0123456789ab"
    assert parse_uri(uri, 7) == DistAddress("127.0.0.1", 29511, "v000007-0123456789ab")
    with pytest.raises(StagingError):
        parse_uri(uri, 8)
    with pytest.raises(StagingError):
        parse_uri("file:///tmp/v000007", 7)
    timed = dist_uri("10.0.0.5", 29511, "v000007-0123456789ab", timeout_s=12.5)
    assert timed.endswith("?timeout=12.5") and parse_uri(timed, 7).timeout_s == 12.5
    assert parse_uri(uri, 7).timeout_s == DEFAULT_TIMEOUT_S
    with pytest.raises(StagingError, match="bad timeout"):
        parse_uri(uri + "?timeout=-1", 7)


def test_a_public_host_is_refused_unless_opted_in(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="outside loopback and private"):
        WeightServer(tmp_path, host="8.8.8.8")


def _stepped(state: dict[str, torch.Tensor], lr: float = 1e-4) -> dict[str, torch.Tensor]:
    """`state` after an optimizer-like step: every float moves a little (the sign and exponent bits mostly stay)."""
    g = torch.Generator().manual_seed(7)
    return {k: (v + lr * torch.randn(v.shape, generator=g).to(v.dtype)) if v.numel() else v for k, v in state.items()}


@pytest.fixture
def stepped(
    tmp_path: Path,
) -> tuple[DirectoryStagingStore, StagedUpdate, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    store = DirectoryStagingStore(tmp_path / "trainer-staging", fsync=False)
    v1_state = _state(1) | {"big": torch.randn(256, 256)}
    store.stage(1, 0, v1_state)
    v2_state = _stepped(v1_state)
    v2 = store.stage(2, 1, v2_state)
    return store, v2, v1_state, v2_state


def test_a_delta_against_the_version_the_rank_serves_gives_the_new_bytes(stepped) -> None:
    store, v2, v1_state, v2_state = stepped
    with WeightServer(store.root, bucket_bytes=4096, timeout_s=60, delta=True) as server:
        uri = server.uri(_dirname(v2))
        manifest = read_manifest(uri, 2, timeout_s=60)
        before = len(transport_dist_receive.DELTA_FALLBACKS)
        got = receive_verified(uri, 2, manifest, timeout_s=60, base=DeltaBase(1, v1_state))
        again = receive_verified(uri, 2, manifest, timeout_s=60, base=DeltaBase(1, v1_state))
    for name, t in v2_state.items():
        assert torch.equal(got[name], t) and torch.equal(again[name], t), name
    assert len(transport_dist_receive.DELTA_FALLBACKS) == before
    assert len(server.deltas) == 1  # encoded once, sent twice
    d = server.deltas[0]
    assert (d.version, d.base_version, d.full_bytes) == (2, 1, manifest.total_bytes)
    assert d.fraction < 0.9, d  # a small step leaves the high bytes alone: the XOR compresses


def test_a_base_that_is_not_what_the_rank_claims_falls_back_to_the_full_version(stepped) -> None:
    """A stale rank offers weights it claims are v1 but are not: the delta gives the wrong bytes, the checksums say
    so, and the rank fetches the full version instead of failing or, worse, committing them."""
    store, v2, v1_state, v2_state = stepped
    lying = dict(v1_state) | {"big": v1_state["big"] + 1.0}
    with WeightServer(store.root, timeout_s=60, delta=True) as server:
        uri = server.uri(_dirname(v2))
        manifest = read_manifest(uri, 2, timeout_s=60)
        before = len(transport_dist_receive.DELTA_FALLBACKS)
        got = receive_verified(uri, 2, manifest, timeout_s=60, base=DeltaBase(1, lying))
    assert torch.equal(got["big"], v2_state["big"])
    assert transport_dist_receive.DELTA_FALLBACKS[before:] == ["v2 on base v1: big"]


def test_a_byte_flipped_in_a_delta_is_still_caught(stepped) -> None:
    store, v2, v1_state, _ = stepped
    with WeightServer(store.root, timeout_s=60, delta=True) as server:
        uri = server.uri(_dirname(v2))
        manifest = read_manifest(uri, 2, timeout_s=60)
        with pytest.raises(StagingError) as e:
            receive_verified(uri, 2, manifest, timeout_s=60, base=DeltaBase(1, v1_state), corrupt="big")
    assert (e.value.kind, e.value.tensor) == ("checksum", "big")


def test_no_delta_when_the_server_lacks_the_base(stepped) -> None:
    store, v2, v1_state, v2_state = stepped
    with WeightServer(store.root, timeout_s=60, delta=True) as server:
        uri = server.uri(_dirname(v2))
        manifest = read_manifest(uri, 2, timeout_s=60)
        store.gc([2])  # v1 collected: nothing to take a delta against
        got = receive_verified(uri, 2, manifest, timeout_s=60, base=DeltaBase(1, v1_state))
    assert torch.equal(got["big"], v2_state["big"]) and server.deltas == []


# ------------------------------------------------------------------ versions served from memory, written behind


def _offer(server: WeightServer, root: Path, version: int, state: dict[str, torch.Tensor]) -> tuple[str, str]:
    from rolledger.workers.weights.staging_format import version_dir
    from rolledger.workers.weights.staging_store import build_manifest, prepare_for_save

    tensors = prepare_for_save(state, version)
    manifest = build_manifest(tensors, version, version - 1, "xxh3_128")
    dirname = version_dir(root, version, manifest.digest).name
    return server.offer(dirname, manifest, tensors), dirname


class _SaysWhenWaitedOn(threading.Event):
    """An offered version's durable-copy event that says when a transfer first waits on it: the sender holds the
    version's last bucket back there."""

    def __init__(self) -> None:
        super().__init__()
        self.waited_on = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waited_on.set()
        return super().wait(timeout)


def test_an_offered_version_is_held_back_until_the_trainers_copy_is_written(tmp_path: Path) -> None:
    want = _state(3)
    with WeightServer(tmp_path, bucket_bytes=1000, timeout_s=60) as server:
        uri, dirname = _offer(server, tmp_path, 1, want)
        durable = server._held[dirname].durable = _SaysWhenWaitedOn()
        manifest = read_manifest(uri, 1, timeout_s=60)
        got: list[object] = []
        done = threading.Event()

        def fetch() -> None:
            try:
                got.append(receive_verified(uri, 1, manifest, timeout_s=60))
            except Exception as e:  # noqa: BLE001 - asserted below
                got.append(e)
            done.set()

        threading.Thread(target=fetch, daemon=True).start()
        # the sender reached the last bucket and holds it (an event, not a fixed wait); the receiver cannot finish
        assert durable.waited_on.wait(60), "the transfer never reached its last bucket"
        assert not done.wait(0.5), "the last bucket went out before the trainer's copy was written"
        server.persisted(dirname)
        assert done.wait(60)
    assert isinstance(got[0], VerifiedWeights), got[0]
    assert all(torch.equal(got[0][k], v) for k, v in want.items())


def test_a_copy_that_failed_to_write_fails_every_transfer_of_it(tmp_path: Path) -> None:
    with WeightServer(tmp_path, bucket_bytes=1000, timeout_s=30) as server:
        uri, dirname = _offer(server, tmp_path, 1, _state(3))
        server.persisted(dirname, error="OSError: [Errno 28] No space left on device")
        with pytest.raises(StagingError) as e:
            receive_verified(uri, 1, read_manifest(uri, 1, timeout_s=30), timeout_s=30)
    assert e.value.kind == "transport"
    assert any("No space left" in f for f in server.failed), server.failed


def test_close_ends_every_transfer_before_it_returns(tmp_path: Path) -> None:
    """A transfer still running when the server closes (here: holding back its last bucket for a copy never written)
    has ended, and recorded why, by the time close returns: nothing of torch.distributed runs on a thread of it when
    the process exits (a gloo group torn down by the interpreter's exit aborts the process)."""
    server = WeightServer(tmp_path, bucket_bytes=1000, timeout_s=60)
    uri, _ = _offer(server, tmp_path, 1, _state(3))
    manifest = read_manifest(uri, 1, timeout_s=60)
    got: list[BaseException] = []

    def fetch() -> None:
        try:
            receive_verified(uri, 1, manifest, timeout_s=60)
        except Exception as e:  # noqa: BLE001 - asserted below
            got.append(e)

    receiver = threading.Thread(target=fetch, daemon=True)
    receiver.start()
    while not any(t.name.startswith("weight-send:") for t in threading.enumerate()):
        assert receiver.is_alive(), got
        threading.Event().wait(0.01)  # polling for the server's transfer thread; the receiver's deadline bounds it
    server.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("weight-send:")]
    assert any("closed" in f for f in server.failed), server.failed
    receiver.join(60)
    assert got and isinstance(got[0], StagingError), got


def test_the_dist_store_serves_a_snapshot_and_writes_the_same_version_behind(tmp_path: Path) -> None:
    from rolledger.workers.weights.transport import DistStagingStore

    weights = _state(4)
    want = {k: v.clone() for k, v in weights.items()}
    store = DistStagingStore(tmp_path / "trainer", "127.0.0.1", 0, timeout_s=60, fsync=False)
    try:
        staged = store.stage(1, 0, weights)
        assert staged.timings.write_s == 0.0
        weights["embed.weight"].add_(1.0)  # the trainer trains on; what it staged must not change
        manifest = read_manifest(staged.uri, 1, expected_digest=staged.manifest_digest, timeout_s=60)
        got = receive_verified(staged.uri, 1, manifest, timeout_s=60)
        assert all(torch.equal(got[k], v) for k, v in want.items())
        store.wait_persisted()
        assert store.versions() == [1]
        on_disk = store.load_verified(1, store.read_manifest(1, expected_digest=staged.manifest_digest))
        assert all(torch.equal(on_disk[k], v) for k, v in want.items())
        # a delta against the offered base comes from memory, and is checked like any other
        v2 = store.stage(2, 1, {k: v + 0.5 if v.is_floating_point() else v for k, v in want.items()})
        store.server.delta = True
        base = DeltaBase(1, {k: v.clone() for k, v in want.items()})
        got2 = receive_verified(v2.uri, 2, v2.manifest, timeout_s=60, base=base)
        assert torch.equal(got2["scale"], torch.tensor(2.0))
        assert store.server.deltas and store.server.deltas[-1].base_version == 1
    finally:
        store.close()


def test_a_retired_snapshot_is_reused_only_once_no_transfer_reads_it(tmp_path: Path) -> None:
    """The next snapshot is copied into the memory of a version that left the server, never into one a transfer
    still reads: a version dropped mid-transfer keeps its bytes until that transfer ends."""
    import contextlib

    with WeightServer(tmp_path, timeout_s=30) as server:
        v1 = _state(1)
        _, dir1 = _offer(server, tmp_path, 1, v1)
        assert server.reusable(v1) is None  # nothing retired yet
        with contextlib.ExitStack() as reading:
            server._source(dir1, None, reading)  # a transfer of v1 under way
            server.drop(dir1)
            assert server.reusable(v1) is None, "memory a transfer still reads was handed out"
        free = server.reusable(v1)
        assert free is not None and set(free) == set(v1)
        assert server.reusable(v1) is None  # handed out once
        assert server.reusable({"other": torch.zeros(2)}) is None  # another layout never matches


def test_the_dist_store_copies_each_new_version_into_retired_memory(tmp_path: Path) -> None:
    from rolledger.workers.weights.transport import DistStagingStore

    store = DistStagingStore(tmp_path / "trainer", "127.0.0.1", 0, timeout_s=60, fsync=False)
    reused: list[bool] = []
    reusable = store.server.reusable

    def spy(like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        got = reusable(like)
        reused.append(got is not None)
        return got

    store.server.reusable = spy  # type: ignore[method-assign]
    try:
        for version in range(1, 5):
            want = {k: v + version if v.is_floating_point() else v for k, v in _state(2).items()}
            staged = store.stage(version, version - 1, want)
            got = receive_verified(staged.uri, version, staged.manifest, timeout_s=60)
            assert all(torch.equal(got[k], v) for k, v in want.items()), f"v{version} arrived wrong"
            store.gc({version})  # as the trainer does: the older versions leave, their memory is free
        assert reused == [False, False, True, True]
    finally:
        store.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_nccl_is_refused_in_one_line_where_there_is_no_cuda(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nccl weight transport needs a CUDA device"):
        WeightServer(tmp_path, backend="nccl")


def test_a_restarted_trainer_whose_last_copy_was_never_written_resumes_from_the_published_version(
    redis_client, run_id: str, tmp_path: Path
) -> None:
    """The trainer died while its copy of v2 was being written: v2 could not be prepared anywhere (its last bucket
    was held back), the update aborted, and the restarted trainer finds no v2 of its own. It resumes from v1, the
    published version, instead of crashing on every restart."""
    from logbuilder import LogBuilder

    from rolledger.events.store import EventLog
    from rolledger.workers.policy.policy_model import policy_state
    from rolledger.workers.roles.trainer import TrainerWorker
    from rolledger.workers.weights.transport import DistStagingStore

    model = torch.nn.Linear(4, 3)
    v1_weights = {k: torch.randn_like(v) for k, v in policy_state(model).items()}
    store = DistStagingStore(tmp_path / "trainer", "127.0.0.1", 0, timeout_s=30, fsync=False)
    try:
        s1 = store.stage(1, 0, v1_weights)
        store.wait_persisted()
        b = LogBuilder(run_id=run_id).start_run()
        b.update(1, manifest=s1.manifest_digest, weights=s1.manifest.weights_digest, uri=s1.uri)
        b.update(2, fail_rank=0, uri=store.server.uri("v000002-0123456789ab"))  # never written: aborted
        EventLog(redis_client, run_id).append_many(b.build())
        trainer = TrainerWorker(redis_client, run_id, "trainer#2", model, store)
        trainer.seat.follow()
        assert trainer.follower.state.policy_version == 1 and max(trainer.follower.state.updates) == 2
        trainer._restore_weights()
        assert all(torch.equal(p, v1_weights[k]) for k, p in policy_state(model).items())
    finally:
        store.close()


def test_the_dist_store_overwrites_a_collected_versions_file_in_place_unless_a_transfer_reads_it(
    tmp_path: Path,
) -> None:
    """The trainer's copy of each new version goes into the file of a version it collected (overwritten in place:
    the page cache already holds its pages), and every version still arrives and loads byte-exact. A file that a
    transfer is reading is never taken: it is deleted as before, and the reader's bytes stay what they were."""
    import contextlib
    import os

    from rolledger.workers.weights.staging_format import FREE_FILE, WEIGHTS_FILE
    from rolledger.workers.weights.transport import DistStagingStore

    store = DistStagingStore(tmp_path / "trainer", "127.0.0.1", 0, timeout_s=60, fsync=False)
    root = store.root

    def weights_of(version: int) -> Path:
        return store.local.version_dir(version) / WEIGHTS_FILE

    try:
        inodes: dict[int, int] = {}
        for version in range(1, 5):
            want = {k: v + version if v.is_floating_point() else v for k, v in _state(2).items()}
            staged = store.stage(version, version - 1, want)
            store.wait_persisted()
            inodes[version] = os.stat(weights_of(version)).st_ino
            got = receive_verified(staged.uri, version, staged.manifest, timeout_s=60)
            assert all(torch.equal(got[k], v) for k, v in want.items()), f"v{version} arrived wrong"
            loaded = store.local.load_verified(version, staged.manifest)  # every tensor hashed against the manifest
            assert all(torch.equal(loaded.tensors[k], v) for k, v in want.items())
            store.gc({version})
        # gc after each stage collects v(n-1), whose file the next stage, v(n+1), overwrites
        assert inodes[3] == inodes[1] and inodes[4] == inodes[2], inodes
        assert (root / FREE_FILE).exists()  # v3's, waiting for v5

        # a transfer reading v4's file (v4 left memory: two newer versions are offered) keeps it from being taken
        (root / FREE_FILE).unlink()
        for version in (5, 6):
            store.stage(version, version - 1, {k: v * version for k, v in _state(2).items()})
            store.wait_persisted()
            inodes[version] = os.stat(weights_of(version)).st_ino
        v4_dir = store.local.version_dir(4).name
        with contextlib.ExitStack() as stack:
            _, views, held = store.server._source(v4_dir, None, stack)
            assert held is None  # read from the file
            before = [bytes(v) for v in views]
            store.gc({6})  # collects v4 (read: deleted, not kept) and v5 (kept as the free file)
            assert not (root / v4_dir).exists() and os.stat(root / FREE_FILE).st_ino == inodes[5]
            store.stage(7, 6, {k: v * 7 for k, v in _state(2).items()})
            store.wait_persisted()
            assert os.stat(weights_of(7)).st_ino == inodes[5]
            assert [bytes(v) for v in views] == before  # the reader's file was not overwritten
        store.gc({7})
        assert os.stat(root / FREE_FILE).st_ino == inodes[6]
    finally:
        store.close()
    assert not (root / FREE_FILE).exists()  # nothing but versions is left on disk
