"""The run summary (`runs/<run-id>/summary.json`), computed from the rebuilt state and the log: pure.

Two folds of the log, each a workflows.dispatch registry: the queue of completed-but-untrained groups over time
(`queue_check`: predicted against measured), and the finished samples with their generation time per rank and each
rank's colocated sleeps (`summarize`). The reward pair is `workflows.figures.reward_edges`, the one definition every
view uses."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import RunStatus
from rolledger.workflows.admission import throttle_bound
from rolledger.workflows.dispatch import Handlers
from rolledger.workflows.figures import reward_edges
from rolledger.workflows.incidents import Incident, incidents
from rolledger.workflows.scheduler import estimate_error
from rolledger.workflows.state import RunState


@dataclass(frozen=True)
class Summary:
    run_id: str
    status: RunStatus
    steps: int
    policy_version: int
    events: int
    trajectories: int
    reward_first: float  # mean reward of the first EDGE_STEPS trainer steps (workflows.figures.reward_edges)
    reward_last: float  # mean reward of the last EDGE_STEPS trainer steps
    max_lag: int
    max_queued_bytes: int
    updates_committed: int
    updates_aborted: int
    engine_idle_fraction: float  # fraction of wall time the engines were not generating (mean over ranks), any mode
    # colocated only (None otherwise): fraction of wall time the engines were handed to the trainer, from each rank's
    # EngineSlept to its EngineResumed (asleep, training, waking, the update, the probe), mean over ranks
    handoff_tax: float | None
    logprob_agreement: float  # median over steps of the median |trainer - engine| logprob gap (on-policy tokens)
    agreement_steps: int  # steps whose batch had on-policy tokens to measure it on
    wall_s: float
    groups_admitted: int
    # the scheduler's length estimate (workflows/scheduler.py): mean |estimate - actual| completion tokens per finished
    # sample, against the estimate its group was admitted with
    length_estimate_error: float
    samples_cancelled: int  # cut short by a partial policy or a closed group (a first k reached: their slots freed)
    tokens_wasted: int  # the tokens those samples had generated before the cut
    trajectories_dropped: int
    anomalies: int
    state_digest: str
    queue_check: dict[str, float | None]  # the queue of completed-but-untrained groups: predicted vs measured
    # aborts, quarantines, halts, refusals, lost workers, dead letters: each {event_id, type, version, rank, ranks,
    # phase, tensor, reason} (workflows/incidents.py), in log order, dead letters last
    incidents: list[dict[str, object]] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class _Mark:
    """The queue's running totals at one PolicyPublished (the boundary of an update period)."""

    t: float
    queue: int  # length at the publish
    area: float  # integral of the length over time, from the first event to here
    arrivals: int  # groups completed so far
    departures: int  # groups that left the queue so far
    wait_s: float  # their summed waits
    peak: int  # the longest the queue was since the previous publish


@dataclass
class _Queue:
    """queue_check's fold, one pass: the queue of completed-but-untrained groups as a step function of time, with
    running totals marked at every publish (windows between publishes are differences of two marks)."""

    completed_at: dict[str, float] = field(default_factory=dict)  # groups in the queue -> when they completed
    last_t: float | None = None
    queue: int = 0
    area: float = 0.0
    arrivals: int = 0
    departures: int = 0
    wait_s: float = 0.0
    peak: int = 0  # since the last publish
    max_queue: int = 0
    marks: list[_Mark] = field(default_factory=list)

    def advance(self, t: float) -> None:
        if self.last_t is not None:
            self.area += self.queue * max(t - self.last_t, 0.0)  # wall clocks of two producers may disagree a little
        self.last_t = t if self.last_t is None else max(self.last_t, t)

    def step(self, t: float, delta: int) -> None:
        self.advance(t)
        self.queue += delta
        self.peak = max(self.peak, self.queue)
        self.max_queue = max(self.max_queue, self.queue)

    def left(self, group_id: str, t: float) -> None:
        """A completed group left the queue (consumed, dropped or cancelled)."""
        if group_id in self.completed_at:
            self.departures += 1
            self.wait_s += t - self.completed_at.pop(group_id)
            self.step(t, -1)

    def mark(self, t: float) -> None:
        self.advance(t)
        self.marks.append(_Mark(t, self.queue, self.area, self.arrivals, self.departures, self.wait_s, self.peak))
        self.peak = self.queue


_QUEUE: Handlers[_Queue, None] = Handlers("summary: queue dynamics")


@_QUEUE.on(ev.GroupCompleted)
def _q_completed(q: _Queue, e: ev.Event, p: ev.GroupCompleted) -> None:
    q.arrivals += 1
    q.completed_at[p.group_id] = e.wall_time
    q.step(e.wall_time, +1)


@_QUEUE.on(ev.BatchConsumed)
def _q_consumed(q: _Queue, e: ev.Event, p: ev.BatchConsumed) -> None:
    for gid in p.group_ids:
        q.left(gid, e.wall_time)


def _q_withdrawn(q: _Queue, e: ev.Event, p: ev.TrajectoryDropped | ev.GroupCancelled) -> None:
    q.left(p.group_id, e.wall_time)


_QUEUE.on(ev.TrajectoryDropped)(_q_withdrawn)
_QUEUE.on(ev.GroupCancelled)(_q_withdrawn)


@_QUEUE.on(ev.PolicyPublished)
def _q_published(q: _Queue, e: ev.Event, p: ev.PolicyPublished) -> None:
    q.mark(e.wall_time)


def queue_check(events: list[ev.Event], throttle_cap_groups: int | None = None) -> dict[str, float | None]:
    """The queue of completed-but-untrained groups: what the first half of the run predicts about the second,
    against what the second half measured. `predicted_*` and `measured_*` come from disjoint windows, so an
    agreement is a finding, not an identity.

    The windows run between PolicyPublished events (the start-up fill before the first publish and the end after the
    last are left out): the fit window is the first half of the update periods, the check window the second half.
    From the fit window: arrival rate (groups completed / s), drain rate (groups leaving / s: consumed, dropped or
    cancelled), the mean update period, and the mean wait of the groups that left in it. Then:

    - predicted_growth_per_period_groups = (arrival - drain) x update period: how much the queue grows net over one
      update period; measured_growth_per_period_groups: its net growth per period over the check window
      (queue at the last publish - queue at the middle one, over the number of periods);
    - predicted_mean_queue_groups = arrival x mean wait (Little's law, L = lambda W, with the fit window's rates);
      measured_mean_queue_groups: the time-averaged queue length over the check window;
    - measured_max_growth_in_period_groups: the most the queue rose above its length at a publish before the next
      one, over the check window (the batch that builds up while the trainer trains on the previous one);
    - measured_max_queue_groups over the whole run, against throttle_cap_groups (the most the admission's rate
      throttle ever allows ahead of the trainer, completed or in flight: groups_per_step x (max_lag + 2),
      workflows/admission.py; None without the throttle), a bound.

    Fewer than three publishes give no windows: those figures are None."""
    q = _Queue()
    for e in events:
        _QUEUE.apply(q, e)
    out: dict[str, float | None] = {
        "measured_max_queue_groups": float(q.max_queue),
        "throttle_cap_groups": float(throttle_cap_groups) if throttle_cap_groups is not None else None,
    }
    keys = (
        "fit_window_s",
        "check_window_s",
        "arrival_rate_groups_s",
        "drain_rate_groups_s",
        "update_period_s",
        "predicted_growth_per_period_groups",
        "measured_growth_per_period_groups",
        "predicted_mean_queue_groups",
        "measured_mean_queue_groups",
        "measured_max_growth_in_period_groups",
    )
    marks = q.marks
    periods = len(marks) - 1
    if periods < 2:
        return {**dict.fromkeys(keys), **out}
    mid = periods // 2
    a, m, b = marks[0], marks[mid], marks[-1]
    fit, check = max(m.t - a.t, 1e-9), max(b.t - m.t, 1e-9)
    arrival = (m.arrivals - a.arrivals) / fit
    left = m.departures - a.departures
    drain = left / fit
    mean_wait = (m.wait_s - a.wait_s) / left if left else 0.0
    period = fit / mid
    return {
        "fit_window_s": fit,
        "check_window_s": check,
        "arrival_rate_groups_s": arrival,
        "drain_rate_groups_s": drain,
        "update_period_s": period,
        "predicted_growth_per_period_groups": (arrival - drain) * period,
        "measured_growth_per_period_groups": (b.queue - m.queue) / (periods - mid),
        "predicted_mean_queue_groups": arrival * mean_wait,
        "measured_mean_queue_groups": (b.area - m.area) / check,
        "measured_max_growth_in_period_groups": float(
            max(after.peak - before.queue for before, after in itertools.pairwise(marks[mid:]))
        ),
        **out,
    }


@dataclass
class _Generation:
    """summarize's fold over the log: finished samples, each group's generate-call duration per rank, and each
    rank's colocated handoffs (EngineSlept -> EngineResumed)."""

    trajectories: int = 0
    cancelled: int = 0  # samples cut short (SampleCancelled): a first k reached, a group closed
    wasted_tokens: int = 0  # the tokens they had generated
    group_ms: dict[tuple[int, str], float] = field(default_factory=dict)  # (rank, group) -> its generate call
    slept_at: dict[int, float] = field(default_factory=dict)  # rank -> when its current handoff began
    handoff_s: dict[int, float] = field(default_factory=dict)  # rank -> seconds spent in handoffs so far


_GENERATION: Handlers[_Generation, None] = Handlers("summary: generation")


@_GENERATION.on(ev.SampleFinished)
def _sample_finished(g: _Generation, e: ev.Event, p: ev.SampleFinished) -> None:
    g.trajectories += 1
    key = (p.trajectory.rank, p.trajectory.group_id)
    # one generate call per group; samples stream out as they end, so the call lasted as long as the last one
    g.group_ms[key] = max(g.group_ms.get(key, 0.0), p.gen_ms)


@_GENERATION.on(ev.SampleCancelled)
def _sample_cancelled(g: _Generation, e: ev.Event, p: ev.SampleCancelled) -> None:
    g.cancelled += 1
    g.wasted_tokens += p.tokens


@_GENERATION.on(ev.EngineSlept)
def _engine_slept(g: _Generation, e: ev.Event, p: ev.EngineSlept) -> None:
    g.slept_at.setdefault(p.rank, e.wall_time)


@_GENERATION.on(ev.EngineResumed)
def _engine_resumed(g: _Generation, e: ev.Event, p: ev.EngineResumed) -> None:
    began = g.slept_at.pop(p.rank, None)
    if began is not None:
        g.handoff_s[p.rank] = g.handoff_s.get(p.rank, 0.0) + e.wall_time - began


def summarize(state: RunState, events: Iterable[ev.Event], dead_letters: Iterable[Incident] = ()) -> Summary:
    """`dead_letters`: the run's dead-letter entries as incidents (they are not in the log; the caller reads them)."""
    events = list(events)
    gen = _Generation()
    for e in events:
        _GENERATION.apply(gen, e)
    gen_ms_by_rank: dict[int, float] = {}
    for (rank, _), ms in gen.group_ms.items():
        gen_ms_by_rank[rank] = gen_ms_by_rank.get(rank, 0.0) + ms
    wall = max(state.last_wall_time - state.first_wall_time, 1e-9)
    ranks = state.ranks or {}
    busy = [min(gen_ms_by_rank.get(r, 0.0) / 1e3 / wall, 1.0) for r in ranks] or [0.0]
    for rank, began in gen.slept_at.items():  # a handoff still open at the end of the log lasts until then
        gen.handoff_s[rank] = gen.handoff_s.get(rank, 0.0) + state.last_wall_time - began
    handed = [min(gen.handoff_s.get(r, 0.0) / wall, 1.0) for r in ranks] or [0.0]
    cfg = state.config
    colocated = cfg is not None and cfg.mode == "colocated"
    throttle = throttle_bound(cfg) if cfg is not None else None
    first, last = reward_edges(state.trainer.rewards) or (0.0, 0.0)
    return Summary(
        run_id=state.run_id,
        status=state.status,
        steps=state.trainer.step,
        policy_version=state.policy_version,
        events=state.events_applied,
        trajectories=gen.trajectories,
        reward_first=first,
        reward_last=last,
        max_lag=state.trainer.max_lag,
        max_queued_bytes=state.admission.max_queued_bytes,
        updates_committed=state.updates_committed,
        updates_aborted=state.updates_aborted,
        engine_idle_fraction=1.0 - statistics.fmean(busy),
        handoff_tax=statistics.fmean(handed) if colocated else None,
        logprob_agreement=statistics.median(state.trainer.logprob_gaps) if state.trainer.logprob_gaps else 0.0,
        agreement_steps=len(state.trainer.logprob_gaps),
        wall_s=wall,
        groups_admitted=state.admission.admitted,
        length_estimate_error=estimate_error(state.scheduler)[0],
        samples_cancelled=gen.cancelled,
        tokens_wasted=gen.wasted_tokens,
        trajectories_dropped=state.trainer.dropped_trajectories,
        anomalies=len(state.anomalies),
        state_digest=state.digest(),
        queue_check=queue_check(events, throttle),
        incidents=[i.to_dict() for i in [*incidents(events), *dead_letters]],
    )
