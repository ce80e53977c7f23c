"""The fold and the decode per event type, on a fixed log in memory (run by hand; no Redis):

    python bench/bench_fold.py [--events 200000] [--repeats 5] [--profile]

The log is bench_replay's synthetic run (its RunWriter: the mix of a real run, one weight update every 4 steps),
built once and encoded, so every run of this bench folds the same events. Printed:

- per event type: count, decode us/event (`events.codec.decode` of its bytes) and fold us/event (`workflows.reducer.fold`
  of it, in log order into one RunState), both CPU time (time.process_time, best of `--repeats`; the collector off
  while timing), and the Python function calls one fold of it makes (cProfile's count: deterministic, the measure
  to compare two versions of the reducer with on a loaded machine, where times move with other users' load);
- the totals, and the state's digest (two versions of a pure optimisation of the reducer print the same digest).

`--profile`: cProfile's top functions of the whole fold, by own time.

Per-type fold times are taken event by event (perf_counter_ns around each fold, less the timer's own cost measured
the same way); the total is one uninterrupted fold of the log.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_replay import RunWriter

from rolledger.events.codec import decode, encode
from rolledger.schemas.events import Event
from rolledger.workflows.reducer import fold
from rolledger.workflows.state import RunState


def build(n: int) -> list[bytes]:
    events: list[Event] = []
    writer = RunWriter(events.extend, run_id="bench-fold", group_size=8, ranks=2)
    writer.write(n, groups_per_step=4, update_every=4)
    return [encode(e) for e in events]


def fold_all(events: list[Event]) -> RunState:
    state = RunState()
    for e in events:
        fold(state, e)
    return state


def best_cpu(fn: object, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        t = time.process_time()
        fn()  # type: ignore[operator]
        best = min(best, time.process_time() - t)
        gc.enable()
    return best


def per_type_fold_ns(events: list[Event], repeats: int) -> dict[str, float]:
    """Nanoseconds of fold per event, by type (best of `repeats` whole passes, each in log order)."""
    clock = time.perf_counter_ns
    overhead = min(-(clock() - clock()) for _ in range(10_000))
    best: dict[str, float] = {}
    for _ in range(repeats):
        spent: dict[str, int] = defaultdict(int)
        state = RunState()
        gc.disable()
        for e in events:
            t = clock()
            fold(state, e)
            spent[e.payload.type] += clock() - t - overhead
        gc.enable()
        for k, v in spent.items():
            best[k] = min(best.get(k, float("inf")), float(v))
    return best


def calls_per_type(events: list[Event]) -> dict[str, int]:
    """Python function calls (cProfile's count) of folding each type, summed over the log."""
    calls: dict[str, int] = defaultdict(int)
    state = RunState()
    for e in events:
        prof = cProfile.Profile()
        prof.enable()
        fold(state, e)
        prof.disable()
        calls[e.payload.type] += pstats.Stats(prof).total_calls  # type: ignore[attr-defined]
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="cProfile's top functions of the whole fold")
    args = ap.parse_args()

    blobs = build(args.events)
    events = [decode(b) for b in blobs]
    n = len(events)
    types = Counter(e.payload.type for e in events)
    by_type: dict[str, list[bytes]] = defaultdict(list)
    for e, b in zip(events, blobs, strict=True):
        by_type[e.payload.type].append(b)

    fold_s = best_cpu(lambda: fold_all(events), args.repeats)
    decode_s = best_cpu(lambda: [decode(b) for b in blobs], args.repeats)
    decode_type = {k: best_cpu(lambda bs=bs: [decode(b) for b in bs], args.repeats) for k, bs in by_type.items()}
    fold_type = per_type_fold_ns(events, args.repeats)
    calls = calls_per_type(events)

    print(f"bench_fold: {n:,} events (bench_replay's run), CPU time, best of {args.repeats}")
    print(f"{'type':<22} {'events':>8} {'share':>6} {'decode us':>10} {'fold us':>8} {'calls/fold':>11}")
    for k, count in types.most_common():
        print(
            f"{k:<22} {count:>8} {count / n:>6.1%} {decode_type[k] / count * 1e6:>10.2f} "
            f"{fold_type[k] / count / 1e3:>8.2f} {calls[k] / count:>11.1f}"
        )
    print(
        f"{'all':<22} {n:>8} {1:>6.0%} {decode_s / n * 1e6:>10.2f} {fold_s / n * 1e6:>8.2f} "
        f"{sum(calls.values()) / n:>11.1f}"
    )
    state = fold_all(events)
    print(f"state: {state.events_applied:,} events applied, {len(state.anomalies)} anomalies, digest {state.digest()}")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        fold_all(events)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
