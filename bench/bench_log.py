"""Benchmark of the event log (run by hand): EventLog against raw redis-py on the same bytes, side by side.

    python bench/bench_log.py [--n 20000] [--aof [--fsync always|everysec]] [--repeats 3]

Starts its own redis-server (events.embedded.find_redis_server) on a free loopback port, no persistence unless
--aof (then appendfsync --fsync: always, rolledger's setting, or everysec). Events are ~1 KB SampleFinished (a small trajectory). Measured, best of
--repeats:

- unpipelined append: EventLog.append (encode + XADD) vs raw `xadd` of pre-encoded bytes; events/s and p99 latency;
- pipelined append: EventLog.append_many of 100 events (encode + one Lua call writing them as one entry, with the
  dedupe hash) vs a raw pipeline of 100 XADDs of the same bytes (an entry each);
- idempotent append (Lua with dedupe hash), unpipelined, for reference;
- read: EventLog.read (XRANGE pages of 1000 entries + decode to Event) vs raw XRANGE pages (no decode), of a log
  written by appends of 100 events (an entry each, as a run writes them);
- the codec alone (decode and encode in memory, no Redis): the ceiling for read and append_many.

Ratios are ours / raw; the aims are >= 0.5 on append and >= 100k events/s decoded on read.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from rolledger.events.codec import decode, encode
from rolledger.events.connection import connect
from rolledger.events.embedded import find_redis_server, server_version
from rolledger.events.envelope import make_event
from rolledger.events.store import EventLog, entry_payloads
from rolledger.schemas.config import SamplingParams
from rolledger.schemas.events import Event, SampleFinished
from rolledger.schemas.trajectory import Trajectory

BATCH = 100


def sample_event(i: int, tokens: int = 24) -> Event:
    traj = Trajectory(
        trajectory_id=f"g{i // 8:06d}/{i % 8}",
        group_id=f"g{i // 8:06d}",
        prompt_id=f"p{i}",
        index=i % 8,
        prompt_token_ids=list(range(100, 132)),
        token_ids=list(range(1000, 1000 + tokens)),
        loss_mask=[1] * tokens,
        positions=list(range(32, 32 + tokens)),
        logprobs=[-0.25 - j / 100 for j in range(tokens)],
        logprob_mode="raw",
        finish_reason="stop",
        sampling=SamplingParams(temperature=1.0, max_tokens=64),
        policy_version=3,
        weights_digest="b3:" + "ab" * 32,
        rank=0,
        engine="torch",
        cache_generation=2,
        graph_generation=2,
    )
    return make_event(
        SampleFinished(trajectory=traj, gen_ms=12.5),
        run_id="bench",
        producer="rollout-0",
        policy_version=3,
        causation_id="01J0000000000000000000000",
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def timed(fn: Callable[[], object], n: int, latencies: list[float] | None = None) -> float:
    """Seconds for n calls of fn; per-call latencies appended when a list is given."""
    start = time.perf_counter()
    if latencies is None:
        for _ in range(n):
            fn()
    else:
        for _ in range(n):
            t = time.perf_counter()
            fn()
            latencies.append(time.perf_counter() - t)
    return time.perf_counter() - start


def p99_us(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[int(0.99 * (len(ordered) - 1))] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20_000, help="events per pipelined/read measurement")
    ap.add_argument("--n-unpipelined", type=int, default=5_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--aof", action="store_true", help="appendonly yes (appendfsync: --fsync)")
    ap.add_argument(
        "--fsync",
        choices=("always", "everysec"),
        default="always",
        help="with --aof (default: %(default)s, rolledger's)",
    )
    args = ap.parse_args()

    binary = find_redis_server()
    workdir = Path(tempfile.mkdtemp(prefix="rl-bench-"))
    port = free_port()
    proc = subprocess.Popen(
        [
            str(binary),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(workdir),
            "--appendonly",
            "yes" if args.aof else "no",
            "--appendfsync",
            args.fsync,
            "--logfile",
            str(workdir / "log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = connect(f"redis://127.0.0.1:{port}/0")
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.02)
        run(client, binary, args)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        shutil.rmtree(workdir, ignore_errors=True)


def run(client: Any, binary: Path, args: argparse.Namespace) -> None:
    events = [sample_event(i) for i in range(1000)]
    blobs = [encode(e) for e in events]
    print(
        f"redis-server {'.'.join(map(str, server_version(binary)))} ({binary}), aof={args.fsync if args.aof else 'off'}"
    )
    print(
        f"event: SampleFinished, {len(blobs[0])} bytes encoded; n={args.n}, unpipelined n={args.n_unpipelined}, "
        f"best of {args.repeats}"
    )
    rows: list[tuple[str, float, float, str]] = []

    def best(measure: Callable[[int], tuple[float, list[float]]], n: int) -> tuple[float, float]:
        rate, p99 = 0.0, 0.0
        for rep in range(args.repeats):
            seconds, lats = measure(rep)
            if n / seconds > rate:
                rate, p99 = n / seconds, (p99_us(lats) if lats else 0.0)
        return rate, p99

    # ---- unpipelined append
    n1 = args.n_unpipelined

    def raw_single(rep: int) -> tuple[float, list[float]]:
        key, it = f"raw1:{rep}", iter(range(n1))
        lats: list[float] = []
        t = timed(lambda: client.xadd(key, {b"e": blobs[next(it) % 1000], b"t": b"SampleFinished"}), n1, lats)
        client.delete(key)
        return t, lats

    def ours_single(rep: int) -> tuple[float, list[float]]:
        log, it = EventLog(client, f"ours1-{rep}"), iter(range(n1))
        lats: list[float] = []
        t = timed(lambda: log.append(events[next(it) % 1000]), n1, lats)
        client.delete(log.key)
        return t, lats

    def ours_idem(rep: int) -> tuple[float, list[float]]:
        log, it = EventLog(client, f"idem-{rep}"), iter(range(n1))
        lats: list[float] = []
        fresh = [sample_event(i) for i in range(n1)]  # distinct event ids: every call appends
        t = timed(lambda: log.append_idempotent(fresh[next(it)]), n1, lats)
        client.delete(log.key, log.dedupe)
        return t, lats

    raw_rate, raw_p99 = best(raw_single, n1)
    our_rate, our_p99 = best(ours_single, n1)
    idem_rate, idem_p99 = best(ours_idem, n1)
    rows.append(("append, unpipelined", our_rate, raw_rate, f"p99 {our_p99:.0f} us vs raw {raw_p99:.0f} us"))
    rows.append(("append_idempotent (Lua), unpipelined", idem_rate, raw_rate, f"p99 {idem_p99:.0f} us"))

    # ---- pipelined append, batches of 100
    n = args.n - args.n % BATCH

    def raw_batched(rep: int) -> tuple[float, list[float]]:
        key = f"rawp:{rep}"

        def batch(start: int) -> None:
            pipe = client.pipeline(transaction=False)
            for j in range(start, start + BATCH):
                pipe.xadd(key, {b"e": blobs[j % 1000], b"t": b"SampleFinished"})
            pipe.execute()

        it = iter(range(0, n, BATCH))
        t = timed(lambda: batch(next(it)), n // BATCH)
        client.delete(key)
        return t, []

    def ours_batched(rep: int) -> tuple[float, list[float]]:
        log = EventLog(client, f"oursp-{rep}")
        chunks = [events[j : j + BATCH] for j in range(0, 1000, BATCH)]
        it = iter(range(n // BATCH))
        t = timed(lambda: log.append_many(chunks[next(it) % len(chunks)]), n // BATCH)
        client.delete(log.key)
        return t, []

    raw_p, _ = best(raw_batched, n)
    our_p, _ = best(ours_batched, n)
    rows.append((f"append_many ({BATCH}/entry) vs raw pipeline", our_p, raw_p, ""))

    # ---- read
    log = EventLog(client, "readbench")
    for j in range(0, n, BATCH):  # distinct event ids: append_many skips an id the log already holds
        log.append_many([sample_event(i) for i in range(j, min(j + BATCH, n))])

    def raw_read(rep: int) -> tuple[float, list[float]]:
        start, got, t = "-", 0, time.perf_counter()
        while True:
            page = client.xrange(log.key, start, "+", count=1000)
            got += len(page)
            if len(page) < 1000:
                break
            start = "(" + page[-1][0].decode()
        assert got == -(-n // BATCH)  # entries: the rate is per event, as for the decoded read
        return time.perf_counter() - t, []

    def ours_read(rep: int) -> tuple[float, list[float]]:
        t = time.perf_counter()
        got = sum(1 for _ in log.read(batch=1000))
        assert got == n
        return time.perf_counter() - t, []

    pages = [client.xrange(log.key, "-", "+", count=1000)]
    page_blobs = [data for _, fields in pages[0] for data in entry_payloads(fields)]

    def codec_only(rep: int) -> tuple[float, list[float]]:
        t = time.perf_counter()
        for j in range(n):
            decode(page_blobs[j % len(page_blobs)])
        return time.perf_counter() - t, []

    def encode_only(rep: int) -> tuple[float, list[float]]:
        t = time.perf_counter()
        for j in range(n):
            encode(events[j % 1000])
        return time.perf_counter() - t, []

    raw_r, _ = best(raw_read, n)
    our_r, _ = best(ours_read, n)
    dec_r, _ = best(codec_only, n)
    enc_r, _ = best(encode_only, n)
    rows.append(("read: EventLog.read (decoded) vs raw XRANGE", our_r, raw_r, ""))
    rows.append(("read: EventLog.read vs codec decode alone", our_r, dec_r, f"decode {1e6 / dec_r:.1f} us/event"))
    rows.append(("append_many vs codec encode alone", our_p, enc_r, f"encode {1e6 / enc_r:.1f} us/event"))
    client.delete(log.key)

    print(f"\n{'measurement':<46} {'ours ev/s':>11} {'raw ev/s':>11} {'ratio':>6}  note")
    for name, ours, raw, note in rows:
        print(f"{name:<46} {ours:>11,.0f} {raw:>11,.0f} {ours / raw:>6.2f}  {note}")
    print(
        f"\naims: append ratio >= 0.5 (unpipelined {rows[0][1] / rows[0][2]:.2f}, pipelined {rows[2][1] / rows[2][2]:.2f}); "
        f"decoded read >= 100k ev/s ({our_r:,.0f})"
    )


if __name__ == "__main__":
    main()
