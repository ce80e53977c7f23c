"""Benchmark of replay (run by hand): raw XRANGE vs read+decode (EventLog.read) vs read+decode+fold (rebuild).

    python bench/bench_replay.py [--events 1000000] [--repeats 1] [--group-size 8] [--groups-per-step 4]
                                 [--update-every 4] [--ranks 2] [--no-maps] [--entry-events 1]

Starts its own redis-server (events.embedded.find_redis_server) on a free loopback port, no persistence, and writes
`--events` synthetic events of one run, pipelined, one entry per event by default (`one_entry_each`: the entry the
store writes for an append of one event: the per-event worst case, comparable with the numbers taken before entries
held batches). `--entry-events K` writes every K consecutive events as one entry in the form the store writes for an
append of several (`batched_entries`: `b` = a msgpack array of their codec bytes, `t` = their types), as a run's
appends do (bench_scale's run averages ~18 events per entry); the map baseline is then skipped. The mix is a real
run's,
produced by tests/logbuilder.py's LogBuilder: per group GroupAdmitted, n x SampleStarted, n x SampleFinished (a
32-token prompt and 10-30 generated tokens), n x SampleScored, GroupCompleted; per step BatchConsumed and
TrainStepFinished; every `--update-every` steps a whole weight-update transaction (staged, prepare, pause, commit,
per-rank commit/invalidate/health, publish, resume) over `--ranks` ranks.

Then, on the same stream, one after the other in this process:

- (a) raw XRANGE pages of 1000 entries, no decoding: the transport floor;
- (u) (a) + msgpack's unpack of every event (and of every batch around them), no models built: the floor of any
  decode on this wire format (printed with what it leaves for building models and folding);
- (b) EventLog.read: XRANGE + decode every entry to a validated Event (Trust.VALIDATE, the baseline);
- (c) workflows.replay.rebuild: (b) + the reducer's fold into a RunState;
- (b') EventLog.read(trust=Trust.OWN_LOG): XRANGE + decode as a process reads its own log (since the events
  became msgspec Structs this is the same typed, validating decode as (b); kept to compare with older figures);
- (c') rebuild over (b'): how a process rebuilds its state from its own log;
- the baseline (skip with `--no-maps`): the same entries, ids and order copied to a second stream in the map form
  logs were written in before the positional layout (events.codec.named_form), then (a), (b') and (c') on it.

With `--repeats R` the phases run R rounds in turn and the best wall and best CPU time of each are kept.
Printed per phase: wall seconds, events/s, the client's CPU seconds (less sensitive to other load than wall time),
and the cost of decode (b - a, b' - a) and of the fold (c - b, c' - b'); the fold's cost as a ratio to read+decode;
decoded reads as a ratio to raw XRANGE (aim >= 0.5x); the load average before and after (the machine is shared: other
load slows every phase). The aim: 1M events rebuilt in < 10 s.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack
import redis

from rolledger.events.codec import Trust, encode, named_form
from rolledger.events.connection import connect
from rolledger.events.embedded import find_redis_server, server_version
from rolledger.events.store import BATCH_FIELD, PAYLOAD_FIELD, TYPE_FIELD, EventLog, entry_payloads
from rolledger.schemas.config import AdmissionConfig, RunConfig
from rolledger.schemas.events import Event
from rolledger.workflows.replay import rebuild
from tests.logbuilder import LogBuilder

PAGE = 1000
APPEND_BATCH = 500
AIM_SECONDS_PER_MILLION = 10.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def redis_server(aof: bool = False, deadline_s: float = 20.0) -> Iterator[tuple[str, Path]]:
    """A throwaway redis-server on a free loopback port: yields (url, binary); stopped and its directory removed."""
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
            "yes" if aof else "no",
            "--appendfsync",
            "no",
            "--logfile",
            str(workdir / "log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = connect(url)
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"redis-server did not start; see {workdir / 'log'}") from None
                time.sleep(0.02)  # polling readiness with a deadline
        client.close()
        yield url, binary
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------- the synthetic run
class RunWriter:
    """Plays a whole run with a LogBuilder, step by step, and hands its events to `sink` in batches (for the bench:
    EventLog.append_many, one MULTI/EXEC pipeline per batch).

    The builder keeps per-sample state for lookups; consumed groups are forgotten after each step (its private
    `_started`/`_trajectories` maps) so a million-event run needs memory for one step, not for the whole run.
    """

    def __init__(
        self, sink: Callable[[list[Event]], object], *, run_id: str, group_size: int, ranks: int, seed: int = 0
    ) -> None:
        config = RunConfig(
            group_size=group_size,
            ranks=ranks,
            steps=1_000_000,
            admission=AdmissionConfig(max_queued_bytes=1 << 40, max_lag=4),
        )
        self.b = LogBuilder(config, run_id=run_id)
        self.sink = sink
        self.rng = random.Random(seed)
        self.written = 0
        self.encoded_bytes = 0
        self.by_type: dict[str, int] = {}
        self._pending: list[Event] = []
        self._prompt = list(range(2000, 2032))

    def _flush(self, force: bool = False) -> None:
        self._pending.extend(self.b.events)
        self.b.events.clear()
        while len(self._pending) >= APPEND_BATCH or (force and self._pending):
            chunk, self._pending = self._pending[:APPEND_BATCH], self._pending[APPEND_BATCH:]
            for e in chunk:
                self.by_type[e.type] = self.by_type.get(e.type, 0) + 1
            self.sink(chunk)
            self.written += len(chunk)

    def group(self, rank: int) -> tuple[str, tuple[str, ...], int]:
        b = self.b
        b.admit()
        gid = b.last_group
        n = b.config.group_size
        ids = tuple(f"{gid}/{i}" for i in range(n))
        for sid in ids:
            b.start(sid, rank=rank)
        for i, sid in enumerate(ids):
            k = self.rng.randint(10, 30)
            start = len(self._prompt)
            b.finish(
                sid,
                prompt_token_ids=self._prompt,
                token_ids=[self.rng.randrange(50_000) for _ in range(k)],
                loss_mask=[1] * k,
                positions=list(range(start, start + k)),
                logprobs=[-self.rng.random() * 3 for _ in range(k)],
                finish_reason="stop" if i % 4 else "length",
            )
        for sid in ids:
            b.score(sid, reward=float(self.rng.random() < 0.5))
        b.complete(gid, accepted=ids)
        return gid, ids, b.rank_version.get(rank, 0)

    def step(self, groups: int) -> None:
        b = self.b
        done = [self.group(rank=i % b.config.ranks) for i in range(groups)]
        b.consume(
            [g for g, _, _ in done],
            trajectory_ids=tuple(s for _, ids, _ in done for s in ids),
            versions=tuple(v for _, _, v in done),
        )
        for _, ids, _ in done:
            for sid in ids:
                b._started.pop(sid, None)
                b._trajectories.pop(sid, None)

    def write(self, total: int, *, groups_per_step: int, update_every: int) -> None:
        self.b.start_run()
        step = 0
        while self.written + len(self._pending) + len(self.b.events) < total:
            self.step(groups_per_step)
            step += 1
            if step % update_every == 0:
                self.b.update()
            self._flush()
        self._flush(force=True)


# ---------------------------------------------------------------- measurements
@dataclass
class Phase:
    name: str
    events: int
    wall_s: float
    cpu_s: float

    @property
    def rate(self) -> float:
        return self.events / self.wall_s


def measure(name: str, fn: Any) -> Phase:
    w, c = time.perf_counter(), time.process_time()
    n = fn()
    return Phase(name, n, time.perf_counter() - w, time.process_time() - c)


def one_entry_each(client: Any, key: str) -> Callable[[list[Event]], object]:
    """A RunWriter sink writing each event as its own entry, in the store's one-event form (`e`, `t`), pipelined."""

    def sink(events: list[Event]) -> object:
        pipe = client.pipeline(transaction=False)
        for e in events:
            pipe.xadd(key, {PAYLOAD_FIELD: encode(e), TYPE_FIELD: e.type})
        return pipe.execute()

    return sink


def batched_entries(client: Any, key: str, k: int) -> Callable[[list[Event]], object]:
    """A RunWriter sink writing every `k` consecutive events as one entry in the store's form for an append of several
    (`b` = a msgpack array of their codec bytes, `t` = their types comma-joined), pipelined. The writer's batches are
    multiples of `k` but for the last."""

    def sink(events: list[Event]) -> object:
        pipe = client.pipeline(transaction=False)
        for i in range(0, len(events), k):
            chunk = events[i : i + k]
            if len(chunk) == 1:
                pipe.xadd(key, {PAYLOAD_FIELD: encode(chunk[0]), TYPE_FIELD: chunk[0].type})
                continue
            batch = msgpack.packb([encode(e) for e in chunk], use_bin_type=True)
            pipe.xadd(key, {BATCH_FIELD: batch, TYPE_FIELD: ",".join(e.type for e in chunk)})
        return pipe.execute()

    return sink


def raw_xrange(client: Any, key: str) -> int:
    """XRANGE pages, nothing decoded; returns the entries read."""
    start, got = "-", 0
    while True:
        page = client.xrange(key, start, "+", count=PAGE)
        got += len(page)
        if len(page) < PAGE:
            return got
        start = "(" + page[-1][0].decode()


def raw_unpack(client: Any, key: str) -> int:
    """XRANGE pages + msgpack's unpack of every entry, nothing else (no models, array blobs left as ExtType): the floor
    of any decode on this wire format."""
    start, got = "-", 0
    while True:
        page = client.xrange(key, start, "+", count=PAGE)
        for _, fields in page:
            for data in entry_payloads(fields):
                msgpack.unpackb(data, raw=False, strict_map_key=False)
                got += 1
        if len(page) < PAGE:
            return got
        start = "(" + page[-1][0].decode()


def copy_as_maps(client: Any, source: str, target: str) -> None:
    """Copy every entry of `source` to `target` with the same id and fields, its event re-packed as the
    self-describing map logs were written as before the positional layout (events.codec.named_form)."""
    start = "-"
    while True:
        page = client.xrange(source, start, "+", count=PAGE)
        pipe = client.pipeline(transaction=False)
        for entry_id, fields in page:
            as_map = msgpack.packb(named_form(fields[PAYLOAD_FIELD]), use_bin_type=True)
            pipe.xadd(target, {**fields, PAYLOAD_FIELD: as_map}, id=entry_id)
        pipe.execute()
        if len(page) < PAGE:
            return
        start = "(" + page[-1][0].decode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000, help="events to write and replay")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups-per-step", type=int, default=4)
    ap.add_argument("--update-every", type=int, default=4, help="a weight-update transaction every N steps")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="rounds of (a, b, c); the best wall and cpu of each")
    ap.add_argument(
        "--entry-events",
        type=int,
        default=1,
        help="events per log entry (1: one entry each, the worst case; a run's appends average ~18)",
    )
    ap.add_argument(
        "--no-maps",
        dest="maps",
        action="store_false",
        help="skip the baseline: the same log in the map form entries had before the positional layout",
    )
    args = ap.parse_args()
    if not 1 <= args.entry_events <= APPEND_BATCH or APPEND_BATCH % args.entry_events:
        ap.error(f"--entry-events must divide {APPEND_BATCH}, got {args.entry_events}")
    if args.entry_events > 1:
        args.maps = False  # the map form is of one-event entries

    load_before = os.getloadavg()
    with redis_server() as (url, binary):
        client = connect(url)
        log = EventLog(client, "bench-replay")
        print(
            f"redis-server {'.'.join(map(str, server_version(binary)))} ({binary}), no persistence; "
            f"{os.cpu_count()} CPUs, load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}"
        )

        t = time.perf_counter()
        sink = (
            one_entry_each(client, log.key)
            if args.entry_events == 1
            else batched_entries(client, log.key, args.entry_events)
        )
        writer = RunWriter(sink, run_id=log.run_id, group_size=args.group_size, ranks=args.ranks)
        writer.write(args.events, groups_per_step=args.groups_per_step, update_every=args.update_every)
        setup = time.perf_counter() - t
        n, entries = writer.written, log.length()
        mem = client.info("memory")["used_memory_human"]
        print(
            f"wrote {n:,} events in {entries:,} entries ({n / entries:.1f} events each) in {setup:.1f} s "
            f"({n / setup:,.0f}/s: build + encode + pipelined append); "
            f"redis memory {mem.decode() if isinstance(mem, bytes) else mem}"
        )
        mix = ", ".join(f"{k} {v / n:.1%}" for k, v in sorted(writer.by_type.items(), key=lambda kv: -kv[1])[:8])
        print(f"mix: {mix}")
        sample: Any = client.xrange(log.key, "-", "+", count=2000 // args.entry_events)
        sizes = [len(data) for _, f in sample for data in entry_payloads(f)]
        print(
            f"encoded size: mean {sum(sizes) / len(sizes):.0f} B over the first {len(sizes)} events; "
            f"largest {max(sizes)} B"
        )

        maps = EventLog(client, "bench-replay-maps")
        if args.maps:  # the same entries, ids and order in the map form logs were written in before (the baseline)
            t = time.perf_counter()
            copy_as_maps(client, log.key, maps.key)
            map_sample: Any = client.xrange(maps.key, "-", "+", count=2000)
            map_mean = sum(len(f[b"e"]) for _, f in map_sample) / len(map_sample)
            print(
                f"copied them as maps (the format before the positional layout) in {time.perf_counter() - t:.1f} s: "
                f"mean {map_mean:.0f} B over the first {len(map_sample)} entries "
                f"(positional: {sum(sizes) / len(sizes) / map_mean:.2f}x the bytes)"
            )

        state_box: list[Any] = []

        def folded_from(source: EventLog, trust: Trust) -> int:
            state, _ = rebuild(source.read(batch=PAGE, trust=trust))
            state_box[:] = [state]
            return int(state.events_applied)

        def folded(trust: Trust) -> int:
            return folded_from(log, trust)

        runs = [
            ("(a) raw XRANGE (pages of 1000)", lambda: raw_xrange(client, log.key)),
            ("(u) XRANGE + msgpack unpack only", lambda: raw_unpack(client, log.key)),
            ("(b) read + decode (validated)", lambda: sum(1 for _ in log.read(batch=PAGE))),
            ("(c) read + decode + fold (validated)", lambda: folded(Trust.VALIDATE)),
            ("(b') read + decode (trusted)", lambda: sum(1 for _ in log.read(batch=PAGE, trust=Trust.OWN_LOG))),
            ("(c') read + decode + fold (trusted)", lambda: folded(Trust.OWN_LOG)),
        ]
        if args.maps:
            runs += [
                ("(a-m) raw XRANGE, map entries", lambda: raw_xrange(client, maps.key)),
                ("(b'-m) read + decode (trusted), maps", lambda: sum(1 for _ in maps.read(trust=Trust.OWN_LOG))),
                ("(c'-m) rebuild (trusted), maps", lambda: folded_from(maps, Trust.OWN_LOG)),
            ]
        best: dict[str, Phase] = {}
        for _ in range(args.repeats):  # a, b, c in turn each round: load spikes hit all three alike
            for name, fn in runs:
                p = measure(name, fn)
                expected = entries if name.startswith(("(a)", "(a-m)")) else n  # raw XRANGE counts entries
                assert p.events == expected, f"{name} saw {p.events} of {expected}"
                p = Phase(name, n, p.wall_s, p.cpu_s)
                prev = best.get(name)
                best[name] = p if prev is None else Phase(name, n, min(prev.wall_s, p.wall_s), min(prev.cpu_s, p.cpu_s))
        phases = [best[name] for name, _ in runs]
        load_after = os.getloadavg()

    state = state_box[0]
    a, u, b, c, bt, ct = phases[:6]
    print(f"\nbest of {args.repeats} round(s) of the phases in turn; {args.entry_events} event(s) per entry")
    print(f"{'phase':<38} {'wall s':>8} {'events/s':>11} {'cpu s':>8} {'us/event':>9}")
    for p in phases:
        print(f"{p.name:<38} {p.wall_s:>8.2f} {p.rate:>11,.0f} {p.cpu_s:>8.2f} {p.wall_s / n * 1e6:>9.2f}")
    for label, dec, fold in (("validated", b, c), ("trusted", bt, ct)):
        print(
            f"\n{label}: decode {(dec.wall_s - a.wall_s) / n * 1e6:.2f} us/event wall, "
            f"{(dec.cpu_s - a.cpu_s) / n * 1e6:.2f} cpu; fold {(fold.wall_s - dec.wall_s) / n * 1e6:.2f} us/event wall, "
            f"{(fold.cpu_s - dec.cpu_s) / n * 1e6:.2f} cpu; decoded reads {a.wall_s / dec.wall_s:.2f}x raw XRANGE "
            f"(wall, aim >= 0.5x); rebuild {fold.wall_s / n * 1e6:.1f} s per 1M events"
        )
    print(
        f"\nthe wire format's floor: msgpack's unpack alone costs {(u.wall_s - a.wall_s) / n * 1e6:.2f} us/event "
        f"(wall): read + unpack is {a.wall_s / u.wall_s:.2f}x raw XRANGE before any model is built, and a rebuild "
        f"with a free decode would still take {(u.wall_s + ct.wall_s - bt.wall_s) / n * 1e6:.1f} s per 1M events "
        "(read + unpack + fold)"
    )
    print(f"trusted vs validated: read+decode {b.cpu_s / bt.cpu_s:.2f}x, rebuild {c.cpu_s / ct.cpu_s:.2f}x (cpu)")
    if args.maps:
        am, bm, cm = phases[6:]
        print(
            f"positional vs maps (trusted, cpu): raw XRANGE {am.cpu_s / a.cpu_s:.2f}x faster, "
            f"read + decode {bm.cpu_s / bt.cpu_s:.2f}x, rebuild {cm.cpu_s / ct.cpu_s:.2f}x; "
            f"maps' decoded reads {am.wall_s / bm.wall_s:.2f}x their raw XRANGE (wall)"
        )
    per_million = ct.wall_s / n * 1_000_000
    verdict = "meets" if per_million < AIM_SECONDS_PER_MILLION else "misses"
    print(
        f"rebuild of 1M events (trusted): {per_million:.1f} s {'measured' if n >= 1_000_000 else 'projected'} "
        f"({verdict} the < {AIM_SECONDS_PER_MILLION:.0f} s aim)"
    )
    print(
        f"state: {state.events_applied:,} events applied, {len(state.anomalies)} anomalies, "
        f"digest {state.digest()[:16]}"
    )
    print(
        f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} "
        f"(shared machine: numbers move with other users' load)"
    )


if __name__ == "__main__":
    main()
