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
from rolledger.schemas.statuses import AdmissionReason, WakeTag
from rolledger.workflows.dispatch import Handlers

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


@dataclass
class _Build:
    """build_timeline's fold: the timeline so far and the spans still open."""

    tl: Timeline
    t: float = 0.0  # seconds since the run started, of the event being folded
    queue: int = 0
    group_start: dict[str, tuple[int, float]] = field(default_factory=dict)
    group_end: dict[str, float] = field(default_factory=dict)
    prepare_start: dict[int, float] = field(default_factory=dict)
    prepared_end: dict[int, float] = field(default_factory=dict)
    pause_start: dict[str, float] = field(default_factory=dict)
    update_pause: dict[int, float] = field(default_factory=dict)
    sleep_start: dict[int, tuple[int, float]] = field(default_factory=dict)

    def queued(self, delta: int) -> None:
        self.queue += delta
        self.tl.queued.append((self.t, self.queue))


_BUILD: Handlers[_Build, None] = Handlers("timeline")


@_BUILD.on(ev.GroupCompleted)
def _group_completed(b: _Build, e: ev.Event, p: ev.GroupCompleted) -> None:
    b.queued(+1)


@_BUILD.on(ev.BatchConsumed)
def _batch_consumed(b: _Build, e: ev.Event, p: ev.BatchConsumed) -> None:
    b.queued(-len(p.group_ids))
    for lag in p.lags:
        b.tl.lag_histogram[lag] = b.tl.lag_histogram.get(lag, 0) + 1


@_BUILD.on(ev.TrajectoryDropped)
def _trajectory_dropped(b: _Build, e: ev.Event, p: ev.TrajectoryDropped) -> None:
    b.queued(-1)


@_BUILD.on(ev.SampleStarted)
def _sample_started(b: _Build, e: ev.Event, p: ev.SampleStarted) -> None:
    if p.group_id not in b.group_start:
        b.group_start[p.group_id] = (p.rank, b.t)


def _sample_ended(b: _Build, e: ev.Event, p: ev.SampleFinished | ev.SampleCancelled | ev.SampleFailed) -> None:
    gid = p.trajectory.group_id if isinstance(p, ev.SampleFinished) else p.group_id
    b.group_end[gid] = b.t


_BUILD.on(ev.SampleFinished)(_sample_ended)
_BUILD.on(ev.SampleCancelled)(_sample_ended)
_BUILD.on(ev.SampleFailed)(_sample_ended)


@_BUILD.on(ev.TrainStepFinished)
def _train_step(b: _Build, e: ev.Event, p: ev.TrainStepFinished) -> None:
    b.tl.add(
        "trainer", b.t - p.train_ms / 1e3, b.t, "train", f"step {p.step}: reward {p.reward_mean:.3f}, loss {p.loss:.3f}"
    )


@_BUILD.on(ev.PrepareRequested)
def _prepare_requested(b: _Build, e: ev.Event, p: ev.PrepareRequested) -> None:
    b.prepare_start[p.version] = b.t


@_BUILD.on(ev.RankPrepared)
def _rank_prepared(b: _Build, e: ev.Event, p: ev.RankPrepared) -> None:
    b.prepared_end[p.version] = b.t


@_BUILD.on(ev.AdmissionPaused)
def _admission_paused(b: _Build, e: ev.Event, p: ev.AdmissionPaused) -> None:
    b.pause_start.setdefault(p.reason, b.t)
    if p.reason == AdmissionReason.UPDATE:
        b.update_pause[max(b.prepare_start, default=0)] = b.t


@_BUILD.on(ev.AdmissionResumed)
def _admission_resumed(b: _Build, e: ev.Event, p: ev.AdmissionResumed) -> None:
    if p.reason in b.pause_start:
        b.tl.add(f"admission: {p.reason}", b.pause_start.pop(p.reason), b.t, "paused", f"admission paused: {p.reason}")


def _update_closed(b: _Build, e: ev.Event, p: ev.PolicyPublished | ev.UpdateAborted) -> None:
    v, t = p.version, b.t
    if v in b.prepare_start:
        b.tl.add("updates", b.prepare_start[v], b.prepared_end.get(v, t), "prepare", f"v{v} prepare")
    kind: SpanKind
    if isinstance(p, ev.PolicyPublished):
        kind, label = "commit", f"v{v} published"
    else:
        kind, label = "abort", f"v{v} aborted: {p.reason}"
    b.tl.add("updates", b.update_pause.get(v, b.prepared_end.get(v, t)), t, kind, label)


_BUILD.on(ev.PolicyPublished)(_update_closed)
_BUILD.on(ev.UpdateAborted)(_update_closed)


@_BUILD.on(ev.EngineSlept)
def _engine_slept(b: _Build, e: ev.Event, p: ev.EngineSlept) -> None:
    b.sleep_start[p.rank] = (p.level, b.t)


@_BUILD.on(ev.EngineWoke)
def _engine_woke(b: _Build, e: ev.Event, p: ev.EngineWoke) -> None:
    if p.rank in b.sleep_start and WakeTag.KV_CACHE in p.tags:
        level, since = b.sleep_start.pop(p.rank)
        b.tl.add(f"rank {p.rank}", since, b.t, "asleep", f"asleep (level {level})")


def build_timeline(events: Iterable[ev.Event]) -> Timeline:
    b = _Build(Timeline())
    tl = b.tl
    t0: float | None = None
    last = 0.0
    for e in events:
        if t0 is None:
            t0 = e.wall_time
            tl.run_id = e.run_id
            tl.rows.extend(["trainer", "updates"])
        b.t = e.wall_time - t0
        last = max(last, b.t)
        _BUILD.apply(b, e)
    for reason, start in b.pause_start.items():
        tl.add(f"admission: {reason}", start, last, "paused", f"admission paused: {reason}")
    per_rank: dict[int, list[tuple[float, float, str]]] = {}
    for gid, (rank, start) in b.group_start.items():
        per_rank.setdefault(rank, []).append((start, b.group_end.get(gid, last), gid))
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
