"""Prometheus metrics of a run (`rolledger run --metrics-port N`), fed from the log as the run's follower reads it.

policy version; queued bytes; lag now; admission state per reason; remaining tokens (the scheduler's current
estimate, updated as samples finish) per in-flight group and that estimate's mean error per finished sample;
a histogram of consumption lag (trained version minus the version that generated the group); counters of updates by
outcome. Each process owns its own registry so tests and runs never share one.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import AdmissionReason
from rolledger.workflows.dispatch import Handlers
from rolledger.workflows.scheduler import estimate_error, group_remaining_tokens
from rolledger.workflows.state import RunState

ADMISSION_REASONS = tuple(AdmissionReason)


class RunMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.policy_version = Gauge("rolledger_policy_version", "last published policy version", registry=r)
        self.queued_bytes = Gauge("rolledger_queued_bytes", "bytes of completed, untrained groups", registry=r)
        self.lag = Gauge("rolledger_lag_versions", "current version minus the oldest untrained version", registry=r)
        self.admission_paused = Gauge(
            "rolledger_admission_paused", "1 while admission is paused for the reason", ["reason"], registry=r
        )
        self.remaining = Gauge(
            "rolledger_group_remaining_tokens", "estimated tokens a group still has to generate", ["group"], registry=r
        )
        self.est_error = Gauge(
            "rolledger_scheduler_estimate_error_tokens",
            "mean error per finished sample of the scheduler's length estimate (abs: absolute; signed: estimate "
            "minus actual)",
            ["kind"],
            registry=r,
        )
        self.consumed_lag = Histogram(
            "rolledger_consumed_lag_versions",
            "trained version minus generating version",
            buckets=(0, 1, 2, 3, 4, 8),
            registry=r,
        )
        self.updates = Counter("rolledger_updates_total", "weight updates by outcome", ["outcome"], registry=r)
        self.trajectories = Counter("rolledger_trajectories_total", "finished samples", registry=r)
        self._groups: set[str] = set()

    def observe(self, state: RunState, new_events: Iterable[ev.Event]) -> None:
        for e in new_events:
            _COUNTERS.apply(self, e)
        self.policy_version.set(state.policy_version)
        self.queued_bytes.set(state.admission.queued_bytes)
        self.lag.set(state.lag)
        for reason in ADMISSION_REASONS:
            self.admission_paused.labels(reason).set(1 if reason in state.admission.paused else 0)
        live = {g.group_id: g for g in state.groups.values() if g.status.is_open}
        for gid in self._groups - live.keys():
            self.remaining.remove(gid)
        if state.config is not None:
            for gid, g in live.items():
                self.remaining.labels(gid).set(group_remaining_tokens(state, state.config, g))
        self._groups = set(live)
        mean_abs, mean_signed = estimate_error(state.scheduler)
        self.est_error.labels("abs").set(mean_abs)
        self.est_error.labels("signed").set(mean_signed)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)


# ---------------------------------------------------------------- the counters and histograms fed per event
_COUNTERS: Handlers[RunMetrics, None] = Handlers("metrics")


@_COUNTERS.on(ev.BatchConsumed)
def _consumed(m: RunMetrics, e: ev.Event, p: ev.BatchConsumed) -> None:
    for lag in p.lags:
        m.consumed_lag.observe(lag)


@_COUNTERS.on(ev.PolicyPublished)
def _published(m: RunMetrics, e: ev.Event, p: ev.PolicyPublished) -> None:
    m.updates.labels("published").inc()


@_COUNTERS.on(ev.UpdateAborted)
def _aborted(m: RunMetrics, e: ev.Event, p: ev.UpdateAborted) -> None:
    m.updates.labels("aborted").inc()


@_COUNTERS.on(ev.SampleFinished)
def _finished(m: RunMetrics, e: ev.Event, p: ev.SampleFinished) -> None:
    m.trajectories.inc()
