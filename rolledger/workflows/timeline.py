"""The timeline of a run, extracted from its log alone (pure: `build_timeline` reads nothing but the events).

Per rank the groups it generated and the bubbles between them, the trainer's steps, every weight update (prepare,
then the paused window up to publish or abort), admission pauses by reason, and sleep/wake handoffs; and the lag
histogram of consumed groups and the queue waiting for the trainer. Beside the spans: every train step's reward and
logprob agreement (`steps`, refused steps included) and every update's outcome with the ranks that caused an abort
and the phase they failed in (`updates`). Drawing it (PNG, HTML) is `rolledger.workers.operator.timeline_render`'s job.
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


@dataclass(frozen=True)
class StepPoint:
    """One train step: its reward and the trainer-engine logprob agreement it measured.

    `gap_median`/`gap_p99` are |trainer - engine| logprob over `agreement_tokens` on-policy tokens; with none the
    step measured nothing (`measured` is False) and the gaps mean nothing. A refused step (`refused` = its reason)
    did not train: its reward and loss are NaN, its gaps are the ones that refused it.
    """

    step: int
    t: float  # seconds since the run started
    reward_mean: float
    loss: float
    gap_median: float
    gap_p99: float
    agreement_tokens: int
    refused: str = ""

    @property
    def measured(self) -> bool:
        return self.agreement_tokens > 0


@dataclass(frozen=True)
class Culprit:
    """A rank an aborted update names, and what it failed at: a prepare phase (prepare, transfer, commit),
    "health", or the deadline it missed ("prepare deadline", "drain deadline"); "" when the log does not say."""

    rank: int
    phase: str
    reason: str = ""
    tensor: str | None = None


UpdateResult = Literal["published", "aborted", "open"]


@dataclass(frozen=True)
class UpdateOutcome:
    """One weight update: when it was requested, prepared, paused for and closed, and how it ended."""

    version: int
    outcome: UpdateResult
    start: float  # PrepareRequested (or the close, when the log has no request)
    end: float  # PolicyPublished / UpdateAborted; the end of the log while open
    prepared: float | None = None  # the last RankPrepared before the close
    paused: float | None = None  # admission paused to commit it
    step: int | None = None  # the train step whose weights it carried
    reason: str = ""  # the abort's reason
    culprits: tuple[Culprit, ...] = ()
    ranks: tuple[int, ...] = ()  # the ranks it was published to

    @property
    def label(self) -> str:
        """ "v3 published", "v3 aborted (rank 3, transfer)", "v2 aborted (superseded by v3)", "v4 open"."""
        if self.outcome != "aborted":
            return f"v{self.version} {self.outcome}"
        if self.culprits:
            phases = {c.phase for c in self.culprits}
            ranks = ", ".join(str(c.rank) for c in self.culprits)
            noun = "rank" if len(self.culprits) == 1 else "ranks"
            if len(phases) == 1 and "" not in phases:
                why = f"{noun} {ranks}, {phases.pop()}"
            elif len(phases) == 1:
                why = f"{noun} {ranks}"
            else:
                why = "; ".join(f"rank {c.rank}, {c.phase or '?'}" for c in self.culprits)
        else:
            why = self.reason if len(self.reason) <= 40 else self.reason[:39] + "…"
        return f"v{self.version} aborted ({why})"


@dataclass
class Timeline:
    run_id: str = ""
    rows: list[str] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    duration: float = 0.0
    lag_histogram: dict[int, int] = field(default_factory=dict)  # consumed groups by lag (trained - generated version)
    queued: list[tuple[float, int]] = field(default_factory=list)  # (t, groups completed but not yet trained)
    steps: list[StepPoint] = field(default_factory=list)  # train steps (and refused ones) in log order
    updates: list[UpdateOutcome] = field(default_factory=list)  # by close (open ones last)

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
    last_step: int | None = None
    staged_step: dict[int, int] = field(default_factory=dict)  # version -> the train step that staged it
    failures: dict[int, dict[int, Culprit]] = field(default_factory=dict)  # version -> rank -> its first failure

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
    b.last_step = p.step
    b.tl.steps.append(
        StepPoint(p.step, b.t, p.reward_mean, p.loss, p.logprob_gap_median, p.logprob_gap_p99, p.agreement_tokens)
    )


@_BUILD.on(ev.TrainStepRefused)
def _train_step_refused(b: _Build, e: ev.Event, p: ev.TrainStepRefused) -> None:
    nan = float("nan")
    b.tl.steps.append(StepPoint(p.step, b.t, nan, nan, p.gap_median, p.gap_p99, p.agreement_tokens, p.reason))


@_BUILD.on(ev.UpdateStaged)
def _update_staged(b: _Build, e: ev.Event, p: ev.UpdateStaged) -> None:
    if b.last_step is not None:
        b.staged_step[p.version] = b.last_step


def _failed(b: _Build, version: int, culprit: Culprit) -> None:
    b.failures.setdefault(version, {}).setdefault(culprit.rank, culprit)


@_BUILD.on(ev.RankPrepareFailed)
def _rank_prepare_failed(b: _Build, e: ev.Event, p: ev.RankPrepareFailed) -> None:
    _failed(b, p.version, Culprit(p.rank, str(p.phase), p.reason, p.tensor))


@_BUILD.on(ev.HealthFailed)
def _health_failed(b: _Build, e: ev.Event, p: ev.HealthFailed) -> None:
    _failed(b, p.version, Culprit(p.rank, "health", p.reason))


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


def _deadline_phase(reason: str) -> str:
    """ "prepare deadline passed for ranks [3]" -> "prepare deadline"; "" for a reason naming no deadline."""
    head, sep, _ = reason.partition(" deadline passed")
    return f"{head.split()[-1]} deadline" if sep and head.split() else ""


def _update_closed(b: _Build, e: ev.Event, p: ev.PolicyPublished | ev.UpdateAborted) -> None:
    v, t = p.version, b.t
    prepared = b.prepared_end.get(v)
    if prepared is not None and prepared > t:  # a rank that prepared after the abort
        prepared = None
    start = b.prepare_start.pop(v, t)
    if start < t:
        b.tl.add("updates", start, t if prepared is None else prepared, "prepare", f"v{v} prepare")
    kind: SpanKind
    if isinstance(p, ev.PolicyPublished):
        outcome = UpdateOutcome(
            v, "published", start, t, prepared, b.update_pause.get(v), b.staged_step.get(v), ranks=p.ranks
        )
        kind, label = "commit", outcome.label
    else:
        failed = b.failures.get(v, {})
        culprits = tuple(
            failed.get(r) or Culprit(r, _deadline_phase(p.reason), p.reason)
            for r in (p.failed_ranks or tuple(sorted(failed)))
        )
        outcome = UpdateOutcome(
            v, "aborted", start, t, prepared, b.update_pause.get(v), b.staged_step.get(v), p.reason, culprits
        )
        kind, label = "abort", f"{outcome.label}: {p.reason}"
    b.tl.updates.append(outcome)
    b.tl.add("updates", b.update_pause.get(v, t if prepared is None else prepared), t, kind, label)


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
    for v, start in sorted(b.prepare_start.items()):  # still open when the log ends (a live or crashed run)
        tl.add("updates", start, last, "prepare", f"v{v} prepare (open)")
        prepared = b.prepared_end.get(v)
        tl.updates.append(UpdateOutcome(v, "open", start, last, prepared, b.update_pause.get(v), b.staged_step.get(v)))
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
