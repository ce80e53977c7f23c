"""The timeline of a run, extracted from its log alone (pure: `build_timeline` reads nothing but the events).

Per rank the groups it generated and the bubbles between them, the trainer's steps, every weight update (prepare,
then the paused window up to publish or abort), admission pauses by reason, and sleep/wake handoffs; and the lag
histogram of consumed groups and the queue waiting for the trainer. Drawing it (PNG, HTML) is
`rolledger.workers.timeline_render`'s job.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from rolledger.schemas import events as ev

SpanKind = Literal["generate", "bubble", "train", "prepare", "commit", "abort", "paused", "asleep"]


@dataclass(frozen=True)
class Span:
    row: str
    start: float  # seconds since the run started
    end: float
    kind: SpanKind
    label: str


@dataclass
class Timeline:
    run_id: str = ""
    rows: list[str] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    duration: float = 0.0
    lag_histogram: dict[int, int] = field(default_factory=dict)  # consumed groups by lag (trained - generated version)
    queued: list[tuple[float, int]] = field(default_factory=list)  # (t, groups completed but not yet trained)

    def add(self, row: str, start: float, end: float, kind: SpanKind, label: str) -> None:
        if row not in self.rows:
            self.rows.append(row)
        self.spans.append(Span(row, start, max(end, start), kind, label))


def build_timeline(events: Iterable[ev.Event]) -> Timeline:
    tl = Timeline()
    t0: float | None = None
    group_start: dict[str, tuple[int, float]] = {}
    group_end: dict[str, float] = {}
    prepare_start: dict[int, float] = {}
    prepared_end: dict[int, float] = {}
    pause_start: dict[str, float] = {}
    update_pause: dict[int, float] = {}
    sleep_start: dict[int, tuple[int, float]] = {}
    last = 0.0
    queue = 0
    for e in events:
        if t0 is None:
            t0 = e.wall_time
            tl.run_id = e.run_id
            tl.rows.extend(["trainer", "updates"])
        t = e.wall_time - t0
        last = max(last, t)
        p = e.payload
        if isinstance(p, ev.GroupCompleted):
            queue += 1
            tl.queued.append((t, queue))
        elif isinstance(p, ev.BatchConsumed):
            queue -= len(p.group_ids)
            tl.queued.append((t, queue))
            for lag in p.lags:
                tl.lag_histogram[lag] = tl.lag_histogram.get(lag, 0) + 1
        elif isinstance(p, ev.TrajectoryDropped):
            queue -= 1
            tl.queued.append((t, queue))
        if isinstance(p, ev.SampleStarted) and p.group_id not in group_start:
            group_start[p.group_id] = (p.rank, t)
        elif isinstance(p, (ev.SampleFinished, ev.SampleCancelled, ev.SampleFailed)):
            gid = p.trajectory.group_id if isinstance(p, ev.SampleFinished) else p.group_id
            group_end[gid] = t
        elif isinstance(p, ev.TrainStepFinished):
            tl.add(
                "trainer",
                t - p.train_ms / 1e3,
                t,
                "train",
                f"step {p.step}: reward {p.reward_mean:.3f}, loss {p.loss:.3f}",
            )
        elif isinstance(p, ev.PrepareRequested):
            prepare_start[p.version] = t
        elif isinstance(p, ev.RankPrepared):
            prepared_end[p.version] = t
        elif isinstance(p, ev.AdmissionPaused):
            pause_start.setdefault(p.reason, t)
            if p.reason == "update":
                update_pause[max(prepare_start, default=0)] = t
        elif isinstance(p, ev.AdmissionResumed) and p.reason in pause_start:
            tl.add(f"admission: {p.reason}", pause_start.pop(p.reason), t, "paused", f"admission paused: {p.reason}")
        elif isinstance(p, (ev.PolicyPublished, ev.UpdateAborted)):
            v = p.version
            if v in prepare_start:
                tl.add("updates", prepare_start[v], prepared_end.get(v, t), "prepare", f"v{v} prepare")
            kind: SpanKind = "commit" if isinstance(p, ev.PolicyPublished) else "abort"
            label = f"v{v} published" if kind == "commit" else f"v{v} aborted: {p.reason}"  # type: ignore[union-attr]
            tl.add("updates", update_pause.get(v, prepared_end.get(v, t)), t, kind, label)
        elif isinstance(p, ev.EngineSlept):
            sleep_start[p.rank] = (p.level, t)
        elif isinstance(p, ev.EngineWoke) and p.rank in sleep_start and "kv_cache" in p.tags:
            level, since = sleep_start.pop(p.rank)
            tl.add(f"rank {p.rank}", since, t, "asleep", f"asleep (level {level})")
    for reason, start in pause_start.items():
        tl.add(f"admission: {reason}", start, last, "paused", f"admission paused: {reason}")
    per_rank: dict[int, list[tuple[float, float, str]]] = {}
    for gid, (rank, start) in group_start.items():
        per_rank.setdefault(rank, []).append((start, group_end.get(gid, last), gid))
    for rank, spans in sorted(per_rank.items()):
        spans.sort()
        prev = 0.0
        for start, end, gid in spans:
            if start > prev:  # bubbles go underneath: sleep spans drawn later cover them
                tl.spans.insert(0, Span(f"rank {rank}", prev, start, "bubble", f"idle {start - prev:.3f}s"))
            tl.add(f"rank {rank}", start, end, "generate", f"group {gid}")
            prev = max(prev, end)
    tl.duration = last
    tl.rows.sort(key=lambda r: (not r.startswith("rank"), r))
    return tl
