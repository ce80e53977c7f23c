"""Incidents: the events a person running the loop must hear about, as one record each. Pure.

An incident is an update that aborted, a rank quarantined, a run that ended other than completed (failed, aborted,
cancelled: a halt), a refused command or train step, a worker lost, or an entry dead-lettered. `IncidentFold.see`
takes one event and returns its incident, or None; it remembers the prepare and health failures it has seen, so an
abort or a quarantine names the phase (and the tensor) that caused it, which its own event only says in prose.
The same fold serves the live log of `rolledger run` (workers/operator/incident_log.py), the summary's `incidents`
(workflows/summary.py) and the `rolledger events` lines (workflows/event_lines.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import RunStatus
from rolledger.workflows.dispatch import Handlers


@dataclass(frozen=True)
class Incident:
    """One incident: the event (or dead-letter entry) id, what happened, the version and rank(s) it concerns, the
    phase and tensor where known, and the reason as the log gives it."""

    event_id: str
    type: str
    version: int | None
    rank: int | None
    reason: str
    ranks: tuple[int, ...] = ()
    phase: str | None = None
    tensor: str | None = None

    @property
    def headline(self) -> str:
        """A few words naming what happened (the log line's message)."""
        return _HEADLINES.get(self.type, self.type)

    def fields(self) -> dict[str, object]:
        """The record's fields without the empty ones (for a log line)."""
        out: dict[str, object] = {"type": self.type, "event_id": self.event_id}
        if self.version is not None:
            out["version"] = self.version
        if len(self.ranks) > 1:
            out["ranks"] = list(self.ranks)
        elif self.rank is not None:
            out["rank"] = self.rank
        if self.phase is not None:
            out["phase"] = self.phase
        if self.tensor is not None:
            out["tensor"] = self.tensor
        out["reason"] = self.reason
        return out

    def to_dict(self) -> dict[str, object]:
        """Every field (the summary's `incidents` entries)."""
        return {
            "event_id": self.event_id,
            "type": self.type,
            "version": self.version,
            "rank": self.rank,
            "ranks": list(self.ranks),
            "phase": self.phase,
            "tensor": self.tensor,
            "reason": self.reason,
        }

    def render(self) -> str:
        """One line: the headline then the fields, e.g. `update aborted v1: rank=3 phase=transfer reason=...`."""
        rest = " ".join(f"{k}={v}" for k, v in self.fields().items() if k not in ("type", "event_id", "version"))
        version = "" if self.version is None else f" v{self.version}"
        return f"{self.headline}{version}: {rest} ({self.event_id})"


_HEADLINES = {
    "UpdateAborted": "update aborted",
    "RankQuarantined": "rank quarantined",
    "RunFinished": "run ended",
    "CommandRefused": "command refused",
    "TrainStepRefused": "train step refused",
    "WorkerLost": "worker lost",
    "DeadLetter": "entry dead-lettered",
}

INCIDENT_TYPES: tuple[str, ...] = tuple(t for t in _HEADLINES if t != "DeadLetter")


@dataclass(frozen=True)
class _Cause:
    phase: str
    tensor: str | None


@dataclass
class IncidentFold:
    """The fold: feed it every event in log order (`see`); it returns each event's incident or None."""

    causes: dict[tuple[int, int], _Cause] = field(default_factory=dict)  # (version, rank) -> what failed there

    def see(self, event: ev.Event) -> Incident | None:
        return _HANDLERS.apply(self, event)

    def cause(self, version: int, ranks: tuple[int, ...]) -> tuple[str | None, str | None]:
        """The phase and tensor of the first of `ranks` known to have failed `version`."""
        for r in ranks:
            c = self.causes.get((version, r))
            if c is not None:
                return c.phase, c.tensor
        return None, None


_HANDLERS: Handlers[IncidentFold, Incident | None] = Handlers("incidents")


@_HANDLERS.on(ev.RankPrepareFailed)
def _prepare_failed(f: IncidentFold, e: ev.Event, p: ev.RankPrepareFailed) -> None:
    f.causes.setdefault((p.version, p.rank), _Cause(str(p.phase), p.tensor))


@_HANDLERS.on(ev.HealthFailed)
def _health_failed(f: IncidentFold, e: ev.Event, p: ev.HealthFailed) -> None:
    f.causes.setdefault((p.version, p.rank), _Cause("health", None))


@_HANDLERS.on(ev.UpdateAborted)
def _aborted(f: IncidentFold, e: ev.Event, p: ev.UpdateAborted) -> Incident:
    phase, tensor = f.cause(p.version, p.failed_ranks)
    rank = p.failed_ranks[0] if p.failed_ranks else None
    return Incident(e.event_id, p.type, p.version, rank, p.reason, p.failed_ranks, phase, tensor)


@_HANDLERS.on(ev.RankQuarantined)
def _quarantined(f: IncidentFold, e: ev.Event, p: ev.RankQuarantined) -> Incident:
    phase, tensor = f.cause(p.version, (p.rank,))
    return Incident(e.event_id, p.type, p.version, p.rank, p.reason, (p.rank,), phase, tensor)


@_HANDLERS.on(ev.RunFinished)
def _finished(f: IncidentFold, e: ev.Event, p: ev.RunFinished) -> Incident | None:
    if p.status == RunStatus.COMPLETED:
        return None
    return Incident(e.event_id, p.type, e.policy_version, None, f"{p.status}: {p.reason or 'no reason given'}")


@_HANDLERS.on(ev.CommandRefused)
def _command_refused(f: IncidentFold, e: ev.Event, p: ev.CommandRefused) -> Incident:
    ranks = () if p.rank is None else (p.rank,)
    return Incident(e.event_id, p.type, None, p.rank, f"{p.command}: {p.reason}", ranks)


@_HANDLERS.on(ev.TrainStepRefused)
def _step_refused(f: IncidentFold, e: ev.Event, p: ev.TrainStepRefused) -> Incident:
    reason = f"step {p.step}: {p.reason} (logprob gap median {p.gap_median:.3g})"
    return Incident(e.event_id, p.type, p.version, None, reason)


@_HANDLERS.on(ev.WorkerLost)
def _worker_lost(f: IncidentFold, e: ev.Event, p: ev.WorkerLost) -> Incident:
    kind = f" ({p.kind})" if p.kind else ""
    return Incident(e.event_id, p.type, None, None, f"{p.worker}{kind}: {p.error or 'died'}")


def incidents(events: list[ev.Event]) -> list[Incident]:
    """Every incident of a log, in log order."""
    fold = IncidentFold()
    return [i for i in (fold.see(e) for e in events) if i is not None]


def dead_letter_incident(dead_letter_id: str, source: str | None, reason: str) -> Incident:
    """An entry copied to the dead-letter stream (a malformed or poison entry): an incident of its own."""
    where = f"entry {source}" if source else "an entry"
    return Incident(dead_letter_id, "DeadLetter", None, None, f"{where}: {reason}")


def from_dict(record: dict[str, object]) -> Incident:
    """An incident back from its `to_dict` form (a summary's `incidents` entry)."""
    ranks = record.get("ranks") or ()
    version, rank = record.get("version"), record.get("rank")
    return Incident(
        event_id=str(record["event_id"]),
        type=str(record["type"]),
        version=version if isinstance(version, int) else None,
        rank=rank if isinstance(rank, int) else None,
        reason=str(record.get("reason", "")),
        ranks=tuple(r for r in ranks if isinstance(r, int)) if isinstance(ranks, list | tuple) else (),
        phase=str(record["phase"]) if record.get("phase") is not None else None,
        tensor=str(record["tensor"]) if record.get("tensor") is not None else None,
    )


def render_incidents(records: list[dict[str, object]]) -> list[str]:
    """The end-of-run list: a count, then one line per incident."""
    if not records:
        return ["incidents: none"]
    return [f"incidents: {len(records)}", *(f"  {from_dict(r).render()}" for r in records)]
