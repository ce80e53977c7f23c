"""Benchmark of the log on a Redis Cluster (run by hand): the same EventLog through a `redis+cluster://` client and
through a plain client of the very primary that serves the run's slot, side by side in one run.

    python bench/bench_cluster.py [--n 2000] [--batch 100] [--repeats 3]

Starts a real 3-primary cluster on loopback (tests/redis_cluster.py, AOF on, appendfsync no). Measured, best of
--repeats, events/s: unpipelined `append` (one Lua call each), `append_many` in batches of --batch, and `read`
(XRANGE pages + decode). The ratio is cluster / single node on the same server: what the cluster client's routing
costs per command. Events are small SampleScored events.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the cluster the tests start

import redis
from redis_cluster import RedisClusterProcesses  # type: ignore[import-not-found]  # tests/ on sys.path above

from rolledger.events.connection import connect
from rolledger.events.envelope import make_event
from rolledger.events.keys import log_key
from rolledger.events.store import EventLog
from rolledger.schemas.events import Event, SampleScored


def events(run: str, n: int) -> list[Event]:
    return [
        make_event(
            SampleScored(sample_id=f"g{i}/0", group_id=f"g{i}", reward=0.5, correct=False),
            run_id=run,
            producer="bench",
            policy_version=0,
        )
        for i in range(n)
    ]


def best(repeats: int, body: Callable[[], int]) -> float:
    """Best events/s of `repeats` runs of body (which returns how many events it handled)."""
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        n = body()
        rates.append(n / (time.perf_counter() - t))
    return max(rates)


def ids_on(cluster: RedisClusterProcesses, primary: int, k: int) -> list[str]:
    """k fresh run ids whose slot the cluster serves on `primary`."""
    out: list[str] = []
    while len(out) < k:
        run = "b" + uuid.uuid4().hex[:8]
        if cluster.primary_of(log_key(run)) == primary:
            out.append(run)
    return out


def measure(client: redis.Redis, runs: list[str], n: int, batch: int, repeats: int) -> dict[str, float]:
    """events/s of append, append_many and read, each on runs of its own (runs: 2 * repeats + 1 ids)."""
    fresh = iter(runs)

    def unpipelined() -> int:
        run = next(fresh)
        log = EventLog(client, run)
        for e in events(run, n):
            log.append(e)
        return n

    def batched() -> int:
        run = next(fresh)
        log = EventLog(client, run)
        evs = events(run, n)
        for i in range(0, n, batch):
            log.append_many(evs[i : i + batch])
        return n

    read_run = next(fresh)
    EventLog(client, read_run).append_many(events(read_run, n))
    return {
        "append": best(repeats, unpipelined),
        "append_many": best(repeats, batched),
        "read": best(repeats, lambda: sum(1 for _ in EventLog(client, read_run).read())),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cluster = RedisClusterProcesses(Path(tempfile.mkdtemp(prefix="bench-cluster-")), primaries=3)
    cluster.start()
    try:
        primary = cluster.ports[0]
        k = 2 * args.repeats + 1
        on_cluster = connect(cluster.url)
        single = connect(f"redis://127.0.0.1:{primary}/0")  # the same server, no routing
        print(f"3-primary cluster on loopback; every measured run on the primary at 127.0.0.1:{primary}")
        print(f"n={args.n} batch={args.batch} repeats={args.repeats}; events/s, best of repeats")
        base = measure(single, ids_on(cluster, primary, k), args.n, args.batch, args.repeats)
        got = measure(on_cluster, ids_on(cluster, primary, k), args.n, args.batch, args.repeats)
        for name in ("append", "append_many", "read"):
            print(
                f"  {name:12s} single-node client {base[name]:9.0f}   cluster client {got[name]:9.0f}   "
                f"ratio {got[name] / base[name]:.2f}"
            )
        on_cluster.close()
        single.close()
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
