"""A soak: one long run under a steady rate of faults, its memory sampled, checked flat (`./dev chaos --soak M`).

One chaos run (harness.py: the driver, a coordinator, two ranks, reward and trainer, each its own process, on their
own redis-server with AOF) whose steps never run out: the coordinator ends it at its run deadline, M minutes after it
started, and that ending is the soak's (counted as finished, not as a stall). Every `fault_every_s` from both ranks'
joining one fault fires, drawn from `Random("soak:<seed>")` among the faults that keep every process alive: a network
fault on one process's path to Redis (latency, reset, stall, partition, through its fault proxy) or a SIGSTOP of a
rank for 6-9 s. Kills and Redis restarts are left out: a restarted process (or server) starts its memory afresh and
would hide the growth the soak is there to see.

Every `sample_every_s` (a minute by default) from the trainer's first step and the log's first trim (before them
the processes are still loading and Redis's live window is still filling) the soak samples each process's RSS (/proc/<pid>/statm) and Redis's `used_memory` (INFO memory). The run's log archives and trims behind a small live window (`[log] keep_live` and
`archive_every` of 200 entries), so Redis holds a bounded window, not the run: its memory must stay flat like the
processes'. Flat: the mean of the last quarter of the samples is at most 1.1 x the mean of the first quarter
(`flatness`), for every process and for Redis. A process restarted during the soak (it crashed) is reported, its
series not judged.

At the end the soak prints its samples, one line per series (first and last quarter, the ratio, flat or not), then
the counts as the chaos suite prints them (faults fired by kind, the summary line) over the same checks (checks.judge:
the audit, acknowledged events lost, trained twice, ...). It passes when every series is flat, and the run has no
violation and lost nothing. One exception, printed apart: a run ended by its deadline leaves the groups it had in
flight open (the coordinator's deadline decision does not cancel them, as its end at the last step does), and the
audit counts each as invariant 7 ("never reached a terminal event before RunFinished"); at the soak's end those are
its in-flight work, not a loss.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from rolledger.events.archive import M_TRIMMED
from rolledger.events.keys import archive_key

from .checks import Ending
from .harness import Harness, Result, prepare_model
from .schedule import Fault, Schedule, Step, Trigger, _net_fault

FLAT_LIMIT = 1.1  # last quarter / first quarter
SOAK_STEPS = 1_000_000  # never reached: the run deadline ends a soak
PROCS = ("driver", "coordinator", "rank0", "rank1", "reward", "trainer")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def soak_schedule(seed: int, minutes: float, fault_every_s: float) -> Schedule:
    """The soak's run and its faults: one every `fault_every_s` seconds from both ranks' joining, to the end."""
    rng = random.Random(f"soak:{seed}")
    faults: list[Step] = []
    n = int(minutes * 60 // fault_every_s)
    for k in range(1, n + 1):
        if rng.random() < 0.8:
            fault = _net_fault(rng, PROCS)
        else:
            fault = Fault("stop", proc=f"rank{rng.randrange(2)}", seconds=round(rng.uniform(6.0, 9.0), 1))
        faults.append(Step(Trigger(at_s=round(k * fault_every_s, 1)), fault))
    return Schedule(seed, steps=SOAK_STEPS, group_size=2, groups_per_step=1, coordinators=1, faults=tuple(faults))


def flatness(samples: Sequence[float], limit: float = FLAT_LIMIT) -> tuple[float, bool]:
    """(mean of the last quarter / mean of the first quarter, whether that is at most `limit`); a quarter is at least
    one sample. Fewer than two samples: (1.0, True), nothing to compare."""
    if len(samples) < 2:
        return 1.0, True
    q = max(1, len(samples) // 4)
    first = sum(samples[:q]) / q
    last = sum(samples[-q:]) / q
    ratio = last / first if first > 0 else float("inf")
    return ratio, ratio <= limit


def rss_bytes(pid: int) -> int | None:
    """The resident set of a live process, None when it is gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class Sample:
    t_s: float  # since the workers started
    rss: dict[str, tuple[int, int]]  # process -> (incarnation, bytes)
    redis_used: int | None
    redis_keys: dict[str, int] = field(default_factory=dict)  # key -> MEMORY USAGE bytes: which key grows


@dataclass
class Series:
    name: str
    values: list[float] = field(default_factory=list)
    restarted: bool = False

    def line(self) -> str:
        mb = [v / 2**20 for v in self.values]
        if self.restarted:
            return f"  {self.name:<12} restarted during the soak: not judged ({_mb(mb)})"
        ratio, ok = flatness(self.values)
        q = max(1, len(mb) // 4)
        return (
            f"  {self.name:<12} first quarter {sum(mb[:q]) / q:7.1f} MB, last quarter {sum(mb[-q:]) / q:7.1f} MB, "
            f"x{ratio:.3f} {'flat' if ok else 'GROWING'} ({_mb(mb)})"
        )

    @property
    def flat(self) -> bool:
        return self.restarted or flatness(self.values)[1]


def _mb(values: Sequence[float]) -> str:
    return "MB: " + " ".join(f"{v:.1f}" for v in values)


class SoakHarness(Harness):
    """The chaos harness with a config whose log window is small and a sampler on its tick."""

    def __init__(self, schedule: Schedule, workdir: Path, model_dir: Path, *, minutes: float, sample_every_s: float):
        super().__init__(schedule, workdir, model_dir, run_deadline_s=minutes * 60, deadline_is_violation=False)
        self.sample_every_s = sample_every_s
        self.samples: list[Sample] = []
        self._next: float | None = None  # the first sample: once the trainer's first step is in the log
        self._memory_client: redis.Redis | None = None
        self.out: Callable[[str], None] = print

    def config_text(self) -> str:
        return super().config_text() + "[log]\nkeep_live = 200\narchive_every = 200\n"

    def tick(self, now: float) -> None:
        if self._next is None:
            if self.counts["TrainStepFinished"] == 0 or not self._trimmed():
                return  # still starting (loading the model, joining), or the live window not yet full
            self._next = now
        if now < self._next:
            return
        self._next += self.sample_every_s
        rss = {}
        for name in PROCS:
            p = self.procs.get(name)
            if p is not None and p.alive and p.popen is not None:
                got = rss_bytes(p.popen.pid)
                if got is not None:
                    rss[name] = (p.incarnation, got)
        sample = Sample(now - self.t0, rss, self._redis_used(), self._redis_keys())
        self.samples.append(sample)
        parts = [f"{n} {b / 2**20:.1f}" + (f"#{i}" if i > 1 else "") for n, (i, b) in rss.items()]
        redis_mb = "?" if sample.redis_used is None else f"{sample.redis_used / 2**20:.2f}"
        self.out(f"t+{sample.t_s:5.0f}s RSS MB: {', '.join(parts)}; redis used_memory {redis_mb} MB")

    def _redis_used(self) -> int | None:
        try:
            if self._memory_client is None:
                self._memory_client = redis.Redis.from_url(self.redis.url, socket_timeout=2.0)
            return int(self._memory_client.info("memory")["used_memory"])
        except (redis.RedisError, OSError, KeyError):
            self._memory_client = None
            return None

    def _trimmed(self) -> bool:
        """Whether the archiver has trimmed the log once: from then on Redis holds a full live window, the size it
        should keep (before it, the window is still filling and Redis grows as it must)."""
        try:
            if self._memory_client is None:
                self._memory_client = redis.Redis.from_url(self.redis.url, socket_timeout=2.0)
            return bool(self._memory_client.hexists(archive_key(self.run_id), M_TRIMMED))
        except (redis.RedisError, OSError):
            self._memory_client = None
            return False

    def _redis_keys(self) -> dict[str, int]:
        """Every key's MEMORY USAGE (SAMPLES 0: all of a stream's or a hash's entries counted), so a growing
        used_memory names the key it grows in; empty when Redis does not answer."""
        try:
            if self._memory_client is None:
                self._memory_client = redis.Redis.from_url(self.redis.url, socket_timeout=2.0)
            client = self._memory_client
            return {k.decode(): int(client.memory_usage(k, samples=0) or 0) for k in client.scan_iter(count=1000)}
        except (redis.RedisError, OSError):
            self._memory_client = None
            return {}

    def key_growth(self, top: int = 5) -> list[str]:
        """The keys whose memory grew most from the first sample to the last, a line each."""
        if len(self.samples) < 2:
            return []
        first, last = self.samples[0].redis_keys, self.samples[-1].redis_keys
        grown = sorted(((last[k] - first.get(k, 0), k) for k in last), reverse=True)[:top]
        return [f"  {k}: {first.get(k, 0) / 1024:.1f} -> {last[k] / 1024:.1f} KB" for d, k in grown if d > 0]

    def series(self) -> list[Series]:
        out = []
        for name in PROCS:
            s = Series(name)
            seen = {x.rss[name][0] for x in self.samples if name in x.rss}
            s.values = [float(x.rss[name][1]) for x in self.samples if name in x.rss]
            s.restarted = len(seen) > 1
            out.append(s)
        out.append(Series("redis", [float(x.redis_used) for x in self.samples if x.redis_used is not None]))
        return out


OPEN_AT_END = "never reached a terminal event before RunFinished"  # invariant 7's message for a unit left open


def open_at_end(violations: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the run's violations, the units it left open at its end) of a soak's run ended by its deadline."""
    inflight = [v for v in violations if v.startswith("audit: invariant 7:") and OPEN_AT_END in v]
    return [v for v in violations if v not in inflight], inflight


@dataclass
class SoakReport:
    result: Result
    series: list[Series]
    samples: int
    violations: list[str]  # the run's, less the units open at a deadline end
    open_at_end: list[str]

    @property
    def flat(self) -> bool:
        return all(s.flat for s in self.series) and self.samples >= 2

    @property
    def ok(self) -> bool:
        return self.flat and not self.violations and not self.result.verdict.lost


def run_soak(
    minutes: float,
    workdir: Path,
    *,
    seed: int = 0,
    fault_every_s: float = 30.0,
    sample_every_s: float = 60.0,
    out: Callable[[str], None] = print,
) -> SoakReport:
    """Run the soak (see the module docstring) in `workdir`, printing as it goes; its report."""
    from .run_chaos import Totals

    if minutes <= 0 or fault_every_s <= 0 or sample_every_s <= 0:
        raise ValueError("--soak minutes, --fault-every and --sample-every must be positive")
    schedule = soak_schedule(seed, minutes, fault_every_s)
    out(
        f"soak: {minutes:g} min, a fault every {fault_every_s:g} s ({len(schedule.faults)}), memory sampled every "
        f"{sample_every_s:g} s; workdir {workdir}"
    )
    model = prepare_model(workdir / "model")
    harness = SoakHarness(schedule, workdir / f"soak{seed}", model, minutes=minutes, sample_every_s=sample_every_s)
    harness.out = out
    start = time.monotonic()
    result = harness.run()
    series = harness.series()
    v = result.verdict
    deadline_end = v.ending is Ending.FAILED_CLOSED and "run deadline" in v.reason
    violations, inflight = open_at_end(v.violations) if deadline_end else (list(v.violations), [])
    report = SoakReport(result, series, len(harness.samples), violations, inflight)
    out(
        f"soak run: {v.ending}{' (' + v.reason + ')' if v.reason else ''}"
        + (", the soak's end" if deadline_end else "")
        + f", {result.events} events, {len(result.faults_fired)} faults fired, {len(violations)} violations, "
        f"{len(v.lost)} lost, {len(result.crashes)} crashes, {time.monotonic() - start:.0f} s"
    )
    for x in result.faults_not_fired:
        out(f"  not fired: {x}")
    for x in violations:
        out(f"  violation: {x}")
    if inflight:
        out(f"  in flight at the soak's end (left open by the deadline, not lost): {len(inflight)} units")
    for a in v.lost[:20]:
        out(f"  lost: {a.event_id} {a.type} (acknowledged to {a.process})")
    for c in result.crashes:
        out(f"  crash: {c.splitlines()[0]}")
    out(f"memory over {report.samples} samples (flat: last quarter <= {FLAT_LIMIT:g} x first quarter):")
    for s in series:
        out(s.line())
    growth = harness.key_growth()
    if growth:
        out("redis keys that grew most, first sample -> last (MEMORY USAGE):")
        for line in growth:
            out(line)
    if report.samples < 2:
        out("  fewer than 2 samples: nothing to compare (a longer --soak, or a shorter --sample-every)")
    totals = Totals()
    totals.add(result)
    if deadline_end:  # the run deadline is how a soak ends: a finished run, not a failed-closed one
        totals.finished, totals.failed_closed = totals.finished + 1, totals.failed_closed - 1
        totals.violations = int(bool(violations))
    out(totals.kinds_line())
    out(totals.line())
    out(f"memory {'flat' if report.flat else 'NOT FLAT'}; soak {'passed' if report.ok else 'FAILED'}")
    return report
