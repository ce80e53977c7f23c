"""Benchmark of the dist weight transport (workers/weights/transport_dist.py), each side against its raw baseline in one run.

The update is a Qwen2.5-0.5B-shaped bf16 state dict (~0.99 GB; --layers for less), sent from this process (the
trainer) to --ranks rank processes over loopback gloo, the ranks receiving concurrently into reused buffers:

  raw         the bytes in the same buckets over a two-member gloo group per rank: no manifest, no checksums, no file
  checked     DistStagingStore.stage (a snapshot and its checksums, offered from memory; the trainer's own file is
              written behind, into the file of a version it collected, with and without fsync, and every
              transfer's last bucket waits for it) + every rank's
              receive_verified (manifest fetched and checked, every tensor hashed against it)
  delta       the next version as a zstd-compressed XOR against the one the ranks serve, applied and checked against
              the full checksums; the "step" multiplies every weight by (1 + 1e-3 * N(0, 1)) in float32 and rounds
              to bf16 (a small optimizer step on bf16 weights: the share of elements it changes is printed)

    python bench/bench_transport.py [--ranks 2] [--reps 3] [--layers 24] [--bucket-mb 64]

It prints where each checked update's time went, per stage (the trainer's snapshot and checksums; its sends:
filling buckets, blocked on the wire, holding the last bucket for the durable copy; each rank's join, wait for bytes,
copy out of a bucket, hashing) and per bucket (rank 0), the delta row (its size, encode cost, whether it beats the
full update, and the link speed below which it would), and the done-when line: checked with fsync off <= 1.5x raw,
fsynced <= 2x, both from this one run.

Ratios are checked / raw of the same reps (median of paired ratios). The first `--warmup` (2) full updates are not
counted: a trainer in its steady state copies each new snapshot into the memory of a version it no longer serves, and
writes its copy into page cache that the versions it collected freed; the first two versions of a run pay for fresh
memory instead (here 0.47 s of page faults per GB for the snapshot, and 0.3-2 s for a new file). Each store collects its older versions after
every update, as the trainer does (at most ~3 GB on disk at once, under a temporary directory).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing.connection
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_update import qwen25_05b_shapes
from rank_procs import RankProcesses

from rolledger.schemas.weights import WeightManifest
from rolledger.workers.weights import transport_dist_receive
from rolledger.workers.weights.staging_checksums import raw_bytes
from rolledger.workers.weights.tensors import state_digest
from rolledger.workers.weights.transport import DistStagingStore
from rolledger.workers.weights.transport_dist import chunks
from rolledger.workers.weights.transport_dist_delta import DeltaBase
from rolledger.workers.weights.transport_dist_receive import read_manifest, receive_verified

DEADLINE_S = 600.0


def _raw_group(store: dist.Store, rank: int) -> Any:
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=DEADLINE_S)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def rank_main(
    conn: multiprocessing.connection.Connection, r: int, port: int, shapes: dict[str, tuple[int, ...]]
) -> None:
    """A rank: answers each command with the seconds it took and a detail."""
    torch.set_num_threads(1)
    buf = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}  # resident, like served weights
    live = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=DEADLINE_S))
    conn.send(("ready", 0.0, None))
    while True:
        cmd, arg = conn.recv()
        if cmd == "exit":
            return
        t0 = time.perf_counter()
        detail: Any = None
        if cmd == "raw":  # arg: (session prefix, bucket bytes)
            prefix, bucket_bytes = arg
            group = _raw_group(dist.PrefixStore(prefix, store), 1)
            views = [raw_bytes(t) for t in buf.values()]
            bucket = torch.empty(bucket_bytes, dtype=torch.uint8)
            src = raw_bytes(bucket)
            for tag, pieces in enumerate(chunks([v.nbytes for v in views], bucket_bytes)):
                n = sum(p[2] for p in pieces)
                group.recv([bucket[:n]], 0, tag).wait()
                at = 0
                for i, lo, length in pieces:
                    views[i][lo : lo + length] = src[at : at + length]
                    at += length
        elif cmd == "checked":  # arg: (uri, version, manifest json, delta base version or 0)
            uri, version, manifest_json, base_version = arg
            manifest = WeightManifest.model_validate_json(manifest_json)
            got_manifest = read_manifest(uri, version, expected_digest=manifest.digest, timeout_s=DEADLINE_S)
            base = DeltaBase(base_version, live) if base_version else None
            got = receive_verified(uri, version, got_manifest, out=buf, timeout_s=DEADLINE_S, base=base)
            detail = got.timings
        elif cmd == "commit":
            for k, v in buf.items():
                live[k].copy_(v)
        elif cmd == "digest":
            detail = state_digest(live)
        conn.send((cmd, time.perf_counter() - t0, detail))


class Ranks(RankProcesses):
    def digests(self) -> set[str]:
        self.send("digest")
        return {d for _, d in self.collect("digest")}


def raw_send(master: dist.TCPStore, sd: dict[str, torch.Tensor], prefix: str, bucket_bytes: int) -> None:
    group = _raw_group(dist.PrefixStore(prefix, master), 0)
    views = [raw_bytes(t) for t in sd.values()]
    bucket = torch.empty(bucket_bytes, dtype=torch.uint8)
    dst = raw_bytes(bucket)
    for tag, pieces in enumerate(chunks([v.nbytes for v in views], bucket_bytes)):
        at = 0
        for i, lo, length in pieces:
            dst[at : at + length] = views[i][lo : lo + length]
            at += length
        group.send([bucket[:at]], 1, tag).wait()


def _sender(master: dist.TCPStore, sd: dict[str, torch.Tensor], prefix: str, bucket_bytes: int) -> Callable[[], None]:
    return lambda: raw_send(master, sd, prefix, bucket_bytes)


def timed_all(fns: list[Callable[[], None]]) -> float:
    """Wall seconds for `fns` run on threads at once (the trainer's sends to every rank)."""
    errors: list[BaseException] = []

    def wrap(f: Callable[[], None]) -> None:
        try:
            f()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=wrap, args=(f,)) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def _stage_parts(
    results: dict[str, list[float]], store: DistStagingStore, fsync: bool, per_rank: list[Any], n_ranks: int
) -> None:
    """Where one checked update's time went, per stage: the trainer's snapshot and checksums, its sends (filling
    buckets, blocked on the wire, holding the last bucket for the durable copy), each rank's manifest and join,
    wait for bytes, copy out of the bucket and hashing."""
    st = store.last_stage
    assert st is not None
    for key, value in (("snapshot", st.snapshot_s), ("checksum", st.checksum_s), ("offer", st.offer_s)):
        results.setdefault(f"trainer {key} fsync={fsync}", []).append(value)
    sends = list(store.server.transfers)[-n_ranks:]
    for key in ("fill_s", "wait_s", "held_s", "total_s"):
        results.setdefault(f"send {key} fsync={fsync}", []).append(statistics.median(getattr(x, key) for x in sends))
    for key, get in (
        ("join", lambda d: d.header_s),
        ("wait", lambda d: sum(b.wait_s for b in d.buckets)),
        ("copy", lambda d: sum(b.copy_s for b in d.buckets)),
        ("hash", lambda d: sum(b.hash_s for b in d.buckets)),
        ("total", lambda d: d.total_s),
    ):
        results.setdefault(f"rank {key} fsync={fsync}", []).append(statistics.median(get(d) for _, d in per_rank))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="full updates first, not counted (see the docstring)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    workdir = Path(tempfile.mkdtemp(prefix="rolledger-bench-transport-", dir=args.dir))
    try:
        run(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(args: argparse.Namespace, workdir: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = qwen25_05b_shapes(args.layers)
    sd = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}
    gb = sum(t.numel() * t.element_size() for t in sd.values()) / 1e9
    bucket = int(args.bucket_mb * (1 << 20))
    print(
        f"state dict: {len(sd)} bf16 tensors, {gb:.3f} GB; ranks={args.ranks} reps={args.reps} bucket={args.bucket_mb:g} MiB"
    )

    results: dict[str, list[float]] = {}
    counted = results
    stores = {
        fsync: DistStagingStore(
            workdir / f"trainer-{fsync}",
            "127.0.0.1",
            0,
            bucket_bytes=bucket,
            timeout_s=DEADLINE_S,
            delta=True,
            fsync=fsync,
        )
        for fsync in (True, False)
    }
    raw_master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=DEADLINE_S)
    )
    ranks = Ranks(rank_main, [(r, raw_master.port, shapes) for r in range(args.ranks)], DEADLINE_S)
    try:
        version = 0
        last_buckets: tuple[Any, ...] = ()
        for rep in range(-args.warmup, args.reps):  # negative reps warm up (not counted): see the docstring
            results = counted if rep >= 0 else {}
            # raw: the same bytes, same buckets, no checks
            prefix = f"raw/{rep}/"
            ranks.send("raw", [(f"{prefix}{r}/", bucket) for r in range(args.ranks)])
            sends: list[Callable[[], None]] = [
                _sender(raw_master, sd, f"{prefix}{r}/", bucket) for r in range(args.ranks)
            ]
            wall = timed_all(sends)
            ranks.collect("raw")
            results.setdefault("raw", []).append(wall)
            # checked, with and without fsync of the trainer's own copy; the ranks receive full versions
            for fsync, store in stores.items():
                version += 1
                t0 = time.perf_counter()
                staged = store.stage(version, version - 1, sd)
                stage_s = time.perf_counter() - t0
                ranks.send("checked", [(staged.uri, version, staged.manifest.model_dump_json(), 0)] * args.ranks)
                per_rank = ranks.collect("checked")
                total = time.perf_counter() - t0
                store.wait_persisted()
                assert store.last_copy is not None
                results.setdefault(f"copy written fsync={fsync}", []).append(store.last_copy.total_s)
                store.gc({version})  # as the trainer does before its next stage: older versions leave the disk
                results.setdefault(f"stage fsync={fsync}", []).append(stage_s)
                results.setdefault(f"checked fsync={fsync}", []).append(total)
                results.setdefault(f"receive+verify fsync={fsync}", []).append(total - stage_s)
                results.setdefault("rank checksum s", []).extend(d.checksum_s for _, d in per_rank)
                _stage_parts(results, store, fsync, per_rank, args.ranks)
                if fsync is False:
                    last_buckets = per_rank[0][1].buckets
        results = counted
        ranks.send("commit")
        ranks.collect("commit")
        digests = ranks.digests()
        assert digests == {staged.manifest.weights_digest}, "the ranks do not hold the manifest's weights"

        # delta: the next version after a small step, against the version every rank now serves
        base_version = version
        store = stores[False]
        step = torch.Generator().manual_seed(1)
        for rep in range(args.reps):
            nxt = {
                k: (v.float() * (1 + 1e-3 * torch.randn(v.shape, generator=step))).to(torch.bfloat16)
                for k, v in sd.items()
            }
            changed = sum(int((a != b).sum()) for a, b in zip(sd.values(), nxt.values(), strict=True))
            elements = sum(t.numel() for t in sd.values())
            version += 1
            t0 = time.perf_counter()
            staged = store.stage(version, base_version, nxt)
            stage_s = time.perf_counter() - t0
            ranks.send("checked", [(staged.uri, version, staged.manifest.model_dump_json(), base_version)] * args.ranks)
            ranks.collect("checked")
            total = time.perf_counter() - t0
            results.setdefault("delta total", []).append(total)
            results.setdefault("delta receive+apply+verify", []).append(total - stage_s)
            ranks.send("commit")
            ranks.collect("commit")
            digests = ranks.digests()
            assert digests == {staged.manifest.weights_digest}, "a delta did not give the manifest's weights"
            sd, base_version = nxt, version
            store.gc({version})
        deltas = store.server.deltas
        assert len(deltas) == args.reps and not transport_dist_receive.DELTA_FALLBACKS, (
            deltas,
            transport_dist_receive.DELTA_FALLBACKS,
        )
    finally:
        ranks.close()
        for s in stores.values():
            s.close()

    med = {k: statistics.median(v) for k, v in results.items()}
    raw = results["raw"]

    def ratio(key: str) -> float:
        return statistics.median(c / r for c, r in zip(results[key], raw, strict=True))

    print(
        f"\nwall seconds until every rank holds the version (median of {args.reps}; ratio = median of paired ratios):"
    )
    print(
        f"  raw gloo send, no checks                         {med['raw']:7.3f} s   ({gb * args.ranks / med['raw']:.2f} GB/s out of the trainer)"
    )
    for fsync in (False, True):
        print(
            f"  checked, trainer's copy fsync={fsync!s:<5}              {med[f'checked fsync={fsync}']:7.3f} s   ratio "
            f"{ratio(f'checked fsync={fsync}'):5.2f}x   (stage {med[f'stage fsync={fsync}']:.3f} s)"
        )
    for fsync in (False, True):
        print(
            f"  the trainer's copy written (behind), fsync={fsync!s:<5} {med[f'copy written fsync={fsync}']:7.3f} s   "
            "(overlaps the transfer; its last bucket waits for it)"
        )
    print(
        f"  of which receive + verify on every rank          {med['receive+verify fsync=False']:7.3f} s   ratio "
        f"{ratio('receive+verify fsync=False'):5.2f}x"
    )
    print(f"  per-rank hashing while receiving                 {med['rank checksum s']:7.3f} s")
    print("\nper stage (median seconds; the trainer's parts are serial, then its sends and the ranks overlap):")
    print("  fsync  snapshot checksum  offer | send: fill  wire  held  total | rank: join  wait  copy  hash  total")
    for fsync in (False, True):
        f = f"fsync={fsync}"
        print(
            f"  {fsync!s:<5}  {med[f'trainer snapshot {f}']:8.3f} {med[f'trainer checksum {f}']:8.3f} "
            f"{med[f'trainer offer {f}']:6.3f} |      {med[f'send fill_s {f}']:5.3f} {med[f'send wait_s {f}']:5.3f} "
            f"{med[f'send held_s {f}']:5.3f} {med[f'send total_s {f}']:6.3f} |       {med[f'rank join {f}']:5.3f} "
            f"{med[f'rank wait {f}']:5.3f} {med[f'rank copy {f}']:5.3f} {med[f'rank hash {f}']:5.3f} "
            f"{med[f'rank total {f}']:6.3f}"
        )
    print("\nper bucket, rank 0's last checked update with fsync=False (ms; wait overlaps the previous bucket's hash):")
    print("  bucket    MiB   wait   copy   hash")
    for i, b in enumerate(last_buckets):
        print(f"  {i:6d} {b.nbytes / (1 << 20):6.1f} {b.wait_s * 1e3:6.1f} {b.copy_s * 1e3:6.1f} {b.hash_s * 1e3:6.1f}")
    frac = statistics.median(d.fraction for d in deltas)
    enc = statistics.median(d.encode_s for d in deltas)
    print(
        f"\ndelta after a step that changed {changed / elements:.1%} of the elements by about one bf16 ulp:\n"
        f"  size {frac:.1%} of the full version ({statistics.median(d.delta_bytes for d in deltas) / 1e6:.0f} MB of "
        f"{deltas[0].full_bytes / 1e6:.0f} MB); encode {enc:.3f} s on the trainer ({gb / enc:.2f} GB/s)\n"
        f"  update total {med['delta total']:.3f} s (ratio {ratio('delta total'):.2f}x raw full send); receive + apply "
        f"+ verify {med['delta receive+apply+verify']:.3f} s including the encode"
    )
    full = med["checked fsync=False"]
    beats = "beats" if med["delta total"] < full else "does not beat"
    print(
        f"  delta row: {frac:.1%} of the bytes, encode {enc:.3f} s; the delta update {med['delta total']:.3f} s "
        f"{beats} the full checked update {full:.3f} s"
    )
    saved = statistics.median(d.full_bytes - d.delta_bytes for d in deltas)
    print(
        f"  a delta pays on a link slower than {saved / enc / 1e9:.2f} GB/s per rank (the bytes it saves / its "
        "encode, encoded once for every rank)"
    )
    off, on = ratio("checked fsync=False"), ratio("checked fsync=True")
    print(
        f"\ndone when: checked (fsync off) <= 1.5x raw: {off:.2f}x {'met' if off <= 1.5 else 'NOT met'}; "
        f"fsynced <= 2x raw: {on:.2f}x {'met' if on <= 2.0 else 'NOT met'} (same run, raw {med['raw']:.3f} s)"
    )


if __name__ == "__main__":
    main()
