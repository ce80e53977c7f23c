"""Benchmark of the weight-update data path: stage -> per-rank prepare (read + verify) -> commit (copy into live).

The update is a Qwen2.5-0.5B-shaped bf16 state dict (hidden 896, intermediate 4864, 24 layers, vocab 151936,
tied embeddings, so about 0.99 GB). Each "rank" is its own process with its own live weights and staging buffer.
Every phase is timed next to the unverified baseline a naive loop would use, in the same run, on the same file:

  stage     DirectoryStagingStore.stage (checksum + write [+ fsync] + rename)  vs  safetensors save_file (no fsync);
            without fsync as a run stages by default (update.staging_fsync), and with it
  prepare   load_verified, fresh memory / into a reused buffer             vs  load_file + clone / + copy_
  commit    copy the verified buffer into the live tensors

`load_file` alone only maps the file (the bytes are read on first touch), so the baselines touch every byte the
way a rank must before it can serve: a clone into fresh memory, or a copy into a preallocated buffer.

    python bench/bench_update.py [--ranks 2] [--reps 3] [--layers 24] [--dir DIR]

It writes about 2 GB under a temporary directory (or --dir) and deletes it afterwards.
"""

from __future__ import annotations

import argparse
import multiprocessing.connection
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import torch
import xxhash
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rank_procs import RankProcesses

from rolledger.schemas.weights import WeightManifest
from rolledger.workers.weights.staging_loader import load_verified
from rolledger.workers.weights.staging_store import DirectoryStagingStore
from rolledger.workers.weights.tensors import state_digest

RANK_DEADLINE_S = 600.0


def qwen25_05b_shapes(layers: int = 24) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of Qwen2.5-0.5B (lm_head tied to embed_tokens, so not stored)."""
    hidden, inter, vocab, kv = 896, 4864, 151936, 128  # 2 KV heads x head_dim 64
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.q_proj.bias": (hidden,),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    return shapes


# ------------------------------------------------------------------------------------------------ one rank


@dataclass
class RankState:
    path: str
    uri: str
    manifest: WeightManifest
    live: dict[str, torch.Tensor]
    buf: dict[str, torch.Tensor]


def rank_main(conn: multiprocessing.connection.Connection, path: str, uri: str, manifest_json: str) -> None:
    """A rank process: answers each command with the seconds it took (and any detail)."""
    torch.set_num_threads(1)
    manifest = WeightManifest.model_validate_json(manifest_json)

    def zeros() -> dict[str, torch.Tensor]:  # allocated and touched: resident like a serving engine's weights
        return {t.name: torch.zeros(t.shape, dtype=torch.bfloat16) for t in manifest.tensors}

    st = RankState(path, uri, manifest, zeros(), zeros())

    def load_file_call() -> Any:
        return len(load_file(st.path))

    def raw_fresh() -> Any:
        x = load_file(st.path)
        y = {k: v.clone() for k, v in x.items()}
        return len(y)

    def raw_buf() -> Any:
        x = load_file(st.path)
        for k, v in x.items():
            st.buf[k].copy_(v)
        return len(x)

    def ours_fresh() -> Any:
        return load_verified(st.uri, st.manifest.version, st.manifest).timings

    def ours_buf() -> Any:
        return load_verified(st.uri, st.manifest.version, st.manifest, out=st.buf).timings

    def commit() -> Any:
        for k, v in st.buf.items():
            st.live[k].copy_(v)
        return None

    def check() -> Any:
        return state_digest(st.live) == st.manifest.weights_digest

    commands: dict[str, Callable[[], Any]] = {
        "load_file_call": load_file_call,
        "raw_fresh": raw_fresh,
        "raw_buf": raw_buf,
        "ours_fresh": ours_fresh,
        "ours_buf": ours_buf,
        "commit": commit,
        "check": check,
    }
    conn.send(("ready", 0.0, None))
    while True:
        cmd, _ = conn.recv()
        if cmd == "exit":
            return
        t0 = time.perf_counter()
        detail = commands[cmd]()
        conn.send((cmd, time.perf_counter() - t0, detail))


# ------------------------------------------------------------------------------------------------ main


def checksum_gbps(tensors: dict[str, torch.Tensor], fn: Callable[[memoryview], object]) -> float:
    views = [t.reshape(-1).view(torch.uint8).numpy().data for t in tensors.values()]
    total = sum(v.nbytes for v in views)
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        for v in views:
            fn(v)
        best = min(best, time.perf_counter() - t0)
    return total / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=24, help="fewer for a quick smoke run")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a new temporary directory)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    workdir = Path(tempfile.mkdtemp(prefix="rolledger-bench-", dir=args.dir))
    try:
        run(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"deleted {workdir}")


def run(args: argparse.Namespace, workdir: Path) -> None:
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    sd = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in qwen25_05b_shapes(args.layers).items()}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    gb = nbytes / 1e9
    print(f"state dict: {len(sd)} bf16 tensors, {nbytes / 1e9:.3f} GB ({time.perf_counter() - t0:.1f}s to build)")
    print(f"ranks={args.ranks} reps={args.reps} cpus={os.cpu_count()} torch threads/process=1 dir={workdir}")

    print("\nchecksum throughput (one thread, in-memory tensors):")
    print(f"  xxh3_128          {checksum_gbps(sd, xxhash.xxh3_128_hexdigest):6.2f} GB/s")
    print(f"  blake3            {checksum_gbps(sd, lambda v: blake3.blake3(v).hexdigest()):6.2f} GB/s")
    auto = blake3.blake3.AUTO
    print(
        f"  blake3 (threads)  {checksum_gbps(sd, lambda v: blake3.blake3(v, max_threads=auto).hexdigest()):6.2f} GB/s"
    )

    # stage vs raw save, same bytes, same disk, alternating which goes first; the directory store as a run uses it
    # (update.staging_fsync = false, the default: a torn copy fails its checksums) and with fsync
    stores = {fsync: DirectoryStagingStore(workdir / f"staging-fsync-{fsync}", fsync=fsync) for fsync in (False, True)}
    raw_path = workdir / "raw.safetensors"
    raw_saves: list[float] = []
    stages: dict[bool, list[Any]] = {False: [], True: []}
    for rep in range(args.reps):
        version = rep + 1
        for what in ("raw", False, True) if rep % 2 == 0 else (True, False, "raw"):
            if what == "raw":
                t = time.perf_counter()
                save_file(sd, str(raw_path))
                raw_saves.append(time.perf_counter() - t)
                raw_path.unlink()
            elif isinstance(what, bool):
                stages[what].append(stores[what].stage(version, version - 1, sd))
                stores[what].gc(keep_versions=[version])
    store = stores[False]
    upd = stages[False][-1]
    del sd
    raw_save_s = statistics.median(raw_saves)
    stage_s = {f: statistics.median(u.timings.total_s for u in stages[f]) for f in stages}
    print(f"\nstage (trainer side, once per update; median of {args.reps}, ratio = median of paired ratios):")
    print(f"  raw save_file (no checksum, no fsync)    {raw_save_s:7.3f} s")
    for fsync, ups in stages.items():
        stage_ratio = statistics.median(u.timings.total_s / r for u, r in zip(ups, raw_saves, strict=True))
        print(
            f"  stage total, fsync={fsync!s:<5}              {stage_s[fsync]:7.3f} s  = checksum "
            f"{statistics.median(u.timings.checksum_s for u in ups):.3f} + write/fsync/rename "
            f"{statistics.median(u.timings.write_s for u in ups):.3f} (of which fsync "
            f"{statistics.median(u.timings.fsync_s for u in ups):.3f})   ratio {stage_ratio:.2f}x"
        )

    path = str(store.version_dir(upd.manifest.version) / upd.manifest.file)
    ranks = RankProcesses(rank_main, [(path, upd.uri, upd.manifest.model_dump_json())] * args.ranks, RANK_DEADLINE_S)
    try:
        results: dict[str, list[float]] = {}
        ours_detail: dict[str, list[Any]] = {"ours_fresh": [], "ours_buf": []}
        order = ["load_file_call", "raw_fresh", "ours_fresh", "raw_buf", "ours_buf", "commit"]
        for rep in range(args.reps):
            for cmd in order if rep % 2 == 0 else order[::-1][1:] + ["commit"]:  # alternate raw/ours order
                wall, per_rank = ranks.run(cmd)
                results.setdefault(cmd, []).append(wall)
                if cmd in ours_detail:
                    ours_detail[cmd].extend(d for _, d in per_rank)
        _, checks = ranks.run("check")
        assert all(ok for _, ok in checks), "live weights do not match the manifest after commit"
    finally:
        ranks.close()

    med = {k: statistics.median(v) for k, v in results.items()}
    print(
        f"\nper-rank phases, {args.ranks} ranks in parallel (median wall of {args.reps} reps until all ranks are done; "
        "ratio = median of paired ratios):"
    )
    print(f"  load_file call only (lazy mmap, no bytes touched)   {med['load_file_call']:7.3f} s")

    def line(label: str, ours: str, raw: str) -> None:
        r = statistics.median(o / w for o, w in zip(results[ours], results[raw], strict=True))
        print(f"  {label:<22} raw {med[raw]:7.3f} s   verified {med[ours]:7.3f} s   ratio {r:5.2f}x")

    line("prepare, fresh memory", "ours_fresh", "raw_fresh")
    line("prepare, reused buffer", "ours_buf", "raw_buf")
    for cmd, label in (("ours_fresh", "fresh"), ("ours_buf", "reused")):
        det = ours_detail[cmd]
        print(
            f"    verified/{label}: read {statistics.median(d.read_s for d in det):.3f} s, checksum "
            f"{statistics.median(d.checksum_s for d in det):.3f} s, header {statistics.median(d.header_s for d in det):.4f} s"
            f" (per rank, median)"
        )
    print(f"  commit (copy into live)                             {med['commit']:7.3f} s")
    naive = raw_save_s + med["raw_buf"] + med["commit"]
    for fsync, ups in stages.items():
        total = stage_s[fsync] + med["ours_buf"] + med["commit"]
        print(
            f"\nupdate total, fsync={fsync!s:<5} (stage + prepare into reused buffer + commit): {total:.3f} s for "
            f"{gb:.2f} GB x {args.ranks} ranks; unverified save_file + load_file/copy + commit: {naive:.3f} s; "
            f"ratio {total / naive:.2f}x"
        )
        overhead = (
            statistics.median(u.timings.checksum_s + u.timings.fsync_s for u in ups) + med["ours_buf"] - med["raw_buf"]
        )
        print(
            f"  cost of fail-closed verification (stage checksum + fsync + extra prepare time): {overhead:.3f} s; the "
            "rest of any stage/save gap is page-cache writeback, which varies run to run on a shared disk"
        )
    print("(the file is read from the page cache: it was just written; a cold read would add disk time to both sides)")


if __name__ == "__main__":
    main()
