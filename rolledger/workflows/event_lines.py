"""The log as a person reads it (`rolledger events`): one line per event, and the filters over it. Pure.

`EventLines.line(stored_id, event)` gives an `EventLine`: the wall time (UTC, ms), the stream id and event id, the
type, the producer, the version the event concerns (when it concerns one) and the few payload fields that matter
for its type (per type, through one workflows.dispatch registry; a type with no entry shows its scalar fields).
The lines are a fold, not a map: an `UpdateAborted` or `RankQuarantined` line names the phase and tensor that caused
it, which the fold learnt from the earlier `RankPrepareFailed`/`HealthFailed` (workflows/incidents.py).

`EventFilter` is what `--type/--group/--rank/--version` select: an event matches when every given filter does
(`--type` and the others may be repeated: any of their values). What an event is *about*:
- group: its `group_id`, the group of its sample/trajectory ids, or any of `group_ids` (BatchConsumed);
- rank: its `rank`, any of `ranks`/`failed_ranks`, or its trajectory's rank;
- version: its payload's `version` (an update's events), its `policy_version` (SampleStarted, RankJoined), its
  trajectory's version, any of `versions` (BatchConsumed); an event with none of these matches on the version in
  force when it was written (the envelope's).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from rolledger.schemas import events as ev
from rolledger.workflows.dispatch import Handlers
from rolledger.workflows.incidents import Incident, IncidentFold

EVENT_TYPES: tuple[str, ...] = tuple(ev.PAYLOAD_TYPES)


def unknown_type_message(name: str) -> str | None:
    """None for a type of the catalogue (schemas/events.py); else one line saying so, with the nearest name."""
    if name in ev.PAYLOAD_TYPES:
        return None
    near = difflib.get_close_matches(name, EVENT_TYPES, n=1, cutoff=0.5)
    if not near:  # a case slip ("updateaborted") is the commonest misspelling
        near = [t for t in EVENT_TYPES if t.lower() == name.lower()]
    hint = f"did you mean {near[0]}?" if near else f"the types are {', '.join(sorted(EVENT_TYPES))}"
    return f"--type {name!r} is not an event type: {hint}"


def iso_utc(wall_time: float) -> str:
    """Unix seconds as `YYYY-MM-DDTHH:MM:SS.mmmZ` (UTC), computed (workflows reads no clock and imports no datetime)."""
    total_ms = math.floor(wall_time * 1000 + 0.5)
    days, ms_of_day = divmod(total_ms, 86_400_000)
    # civil_from_days (H. Hinnant): days since 1970-01-01 -> (y, m, d), proleptic Gregorian
    z = days + 719_468
    era = z // 146_097
    doe = z - era * 146_097
    yoe = (doe - doe // 1460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    d = doy - (153 * mp + 2) // 5 + 1
    m = mp + 3 if mp < 10 else mp - 9
    y = yoe + era * 400 + (1 if m <= 2 else 0)
    s, ms = divmod(ms_of_day, 1000)
    h, s = divmod(s, 3600)
    mi, s = divmod(s, 60)
    return f"{y:04d}-{m:02d}-{d:02d}T{h:02d}:{mi:02d}:{s:02d}.{ms:03d}Z"


# ---------------------------------------------------------------- what each type shows
Fields = dict[str, Any]
_FIELDS: Handlers[IncidentFold, Fields] = Handlers("event lines")


def _show(cls: type[ev.Payload], *names: str) -> None:
    """Register a handler that shows these payload fields, in this order (empty/None ones left out)."""

    def fields(f: IncidentFold, e: ev.Event, p: ev.Payload) -> Fields:
        return {n: getattr(p, n) for n in names}

    _FIELDS.on(cls)(fields)


@_FIELDS.on(ev.RunStarted)
def _run_started(f: IncidentFold, e: ev.Event, p: ev.RunStarted) -> Fields:
    c = p.config
    return {"engine": c.engine, "mode": c.mode, "ranks": c.ranks, "steps": c.steps, "seed": c.seed}


_show(ev.RunFinished, "status", "reason", "steps")
_show(ev.GroupAdmitted, "group_id", "prompt_id", "n", "queued_bytes")
_show(ev.AdmissionPaused, "reason", "lag", "queued_bytes", "detail")
_show(ev.AdmissionResumed, "reason")
_show(ev.SampleStarted, "sample_id", "rank", "policy_version")
_show(ev.SampleFailed, "sample_id", "rank", "error")
_show(ev.SampleCancelled, "sample_id", "reason")
_show(ev.GroupCompleted, "group_id", "status", "accepted")
_show(ev.GroupCancelled, "group_id", "reason")
_show(ev.SampleScored, "sample_id", "reward", "correct")
_show(ev.BatchConsumed, "step", "group_ids", "versions", "lags")
_show(ev.TrajectoryDropped, "group_id", "reason", "lag")
_show(ev.UpdateStaged, "version", "base_version", "tensors", "bytes")
_show(ev.PrepareRequested, "version", "ranks", "fence")
_show(ev.RankPrepared, "version", "rank", "prepare_ms")
_show(ev.RankPrepareFailed, "version", "rank", "phase", "tensor", "reason")
_show(ev.UpdateCommitted, "version", "ranks", "fence")
_show(ev.RankCommitted, "version", "rank", "commit_ms")
_show(ev.CacheInvalidated, "version", "rank", "kind", "generation")
_show(ev.HealthPassed, "version", "rank")
_show(ev.HealthFailed, "version", "rank", "reason")
_show(ev.PolicyPublished, "version", "ranks")
_show(ev.EngineSlept, "rank", "level", "bytes_freed")
_show(ev.EngineWoke, "rank", "tags")
_show(ev.EnginePaused, "rank", "mode")
_show(ev.EngineResumed, "rank")
_show(ev.RankJoined, "rank", "engine", "policy_version", "incarnation")
_show(ev.CommandRefused, "command", "rank", "reason")
_show(ev.TrainStepRefused, "step", "version", "reason", "gap_median")
_show(ev.WorkerLost, "worker", "kind", "error")


@_FIELDS.on(ev.SampleFinished)
def _sample_finished(f: IncidentFold, e: ev.Event, p: ev.SampleFinished) -> Fields:
    t = p.trajectory
    fields: Fields = {
        "trajectory_id": t.trajectory_id,
        "rank": t.rank,
        "tokens": len(t.token_ids),
        "version": t.policy_version,
        "finish": t.finish_reason,
    }
    if t.turns:  # an episode: its turns, each source with its tokens' range (policy [0,3) env [3,5) ...)
        fields["turns"] = " ".join(f"{turn.source}[{turn.start},{turn.end})" for turn in t.turns)
    return fields


@_FIELDS.on(ev.TrainStepFinished)
def _step_finished(f: IncidentFold, e: ev.Event, p: ev.TrainStepFinished) -> Fields:
    return {
        "step": p.step,
        "reward": p.reward_mean,
        "loss": p.loss,
        "agreement": p.logprob_gap_median,
        "agreement_tokens": p.agreement_tokens,
    }


def _generic(p: ev.Payload) -> Fields:
    """A type with no entry above: its scalar fields."""
    values = ((k, getattr(p, k)) for k in p.__struct_fields__)
    return {k: v.value if isinstance(v, Enum) else v for k, v in values if isinstance(v, (str, int, float, bool))}


# ---------------------------------------------------------------- what an event is about
def groups_of(e: ev.Event) -> set[str]:
    p = e.payload
    out: set[str] = set()
    gid = getattr(p, "group_id", None)
    if isinstance(gid, str):
        out.add(gid)
    out.update(getattr(p, "group_ids", ()) or ())
    if isinstance(p, ev.SampleFinished):
        out.add(p.trajectory.group_id)
    for sid in (getattr(p, "sample_id", None), *(getattr(p, "trajectory_ids", ()) or ())):
        if isinstance(sid, str) and "/" in sid:
            out.add(sid.split("/", 1)[0])
    return out


def ranks_of(e: ev.Event) -> set[int]:
    p = e.payload
    out: set[int] = set()
    rank = getattr(p, "rank", None)
    if isinstance(rank, int):
        out.add(rank)
    for name in ("ranks", "failed_ranks"):
        out.update(getattr(p, name, ()) or ())
    if isinstance(p, ev.SampleFinished):
        out.add(p.trajectory.rank)
    return out


def versions_of(e: ev.Event) -> set[int]:
    """The version(s) the event concerns; the one in force when it was written if its payload names none."""
    p = e.payload
    out: set[int] = set()
    for name in ("version", "policy_version"):
        v = getattr(p, name, None)
        if isinstance(v, int):
            out.add(v)
    out.update(getattr(p, "versions", ()) or ())
    if isinstance(p, ev.SampleFinished):
        out.add(p.trajectory.policy_version)
    return out


def _own_version(e: ev.Event) -> int | None:
    """The version a line shows: the one the payload names (a single one), else None."""
    vs = versions_of(e)
    return next(iter(vs)) if len(vs) == 1 else None


@dataclass(frozen=True)
class EventFilter:
    """--type / --group / --rank / --version: empty = any."""

    types: frozenset[str] = frozenset()
    groups: frozenset[str] = frozenset()
    ranks: frozenset[int] = frozenset()
    versions: frozenset[int] = frozenset()

    def matches(self, e: ev.Event) -> bool:
        if self.types and e.type not in self.types:
            return False
        if self.groups and not self.groups & groups_of(e):
            return False
        if self.ranks and not self.ranks & ranks_of(e):
            return False
        return not self.versions or bool(self.versions & (versions_of(e) or {e.policy_version}))

    def may_match_undecodable(self, claimed_type: str | None) -> bool:
        """An entry that did not decode: shown unless --type names other types than the one its `t` field claims
        (nothing else about it can be known, so the other filters never hide it)."""
        return not self.types or claimed_type is None or claimed_type in self.types


# ---------------------------------------------------------------- the lines
@dataclass(frozen=True)
class EventLine:
    stream_id: str
    event_id: str
    wall_time: float
    type: str
    producer: str
    version: int | None
    fields: Fields
    incident: Incident | None = None

    def render(self) -> str:
        version = f"v{self.version}" if self.version is not None else "-"
        rest = " ".join(
            f"{k}={_text(v)}"
            for k, v in self.fields.items()
            if v is not None and v != "" and not (k in ("version", "policy_version") and v == self.version)
        )
        return (
            f"{iso_utc(self.wall_time)}  {self.stream_id:<16} {self.type:<18} {self.producer:<14} {version:<4} {rest}"
        ).rstrip()

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": iso_utc(self.wall_time),
            "wall_time": self.wall_time,
            "stream_id": self.stream_id,
            "event_id": self.event_id,
            "type": self.type,
            "producer": self.producer,
            "version": self.version,
            "fields": {k: _plain(v) for k, v in self.fields.items()},
            "incident": self.incident.to_dict() if self.incident is not None else None,
        }


def undecodable_line(stream_id: str, claimed_type: str | None, reason: str) -> str:
    """The line of an entry that is not an event (it is shown, never skipped)."""
    ms = int(stream_id.partition("-")[0]) if stream_id.partition("-")[0].isdigit() else 0
    when = iso_utc(ms / 1000)  # the entry's own time is unreadable: Redis's, from its stream id
    return f"{when}  {stream_id:<16} {'UNDECODABLE':<18} {'?':<14} {'-':<4} type={claimed_type or '?'} reason={_text(reason)}"


def undecodable_dict(stream_id: str, claimed_type: str | None, reason: str) -> dict[str, Any]:
    return {"stream_id": stream_id, "type": claimed_type, "undecodable": reason}


@dataclass
class EventLines:
    """The fold behind the lines: feed it every event in log order, filtered or not (the causes it remembers come
    from events a filter may hide)."""

    incidents: IncidentFold = field(default_factory=IncidentFold)

    def line(self, stream_id: str, e: ev.Event) -> EventLine:
        incident = self.incidents.see(e)
        if isinstance(e.payload, (ev.UpdateAborted, ev.RankQuarantined)) and incident is not None:
            fields = {k: v for k, v in incident.fields().items() if k not in ("type", "event_id", "version")}
        else:
            got = _FIELDS.apply(self.incidents, e)
            fields = got if got is not None else _generic(e.payload)
        return EventLine(stream_id, e.event_id, e.wall_time, e.type, e.producer, _own_version(e), fields, incident)


def lines(entries: Iterable[tuple[str, ev.Event]], flt: EventFilter = EventFilter()) -> list[EventLine]:
    """The lines of the events `flt` selects, out of (stream id, event) pairs in log order."""
    fold = EventLines()
    out = []
    for sid, e in entries:
        line = fold.line(sid, e)
        if flt.matches(e):
            out.append(line)
    return out


def _plain(v: Any) -> Any:
    if isinstance(v, tuple | list | frozenset | set):
        return [_plain(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _text(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, tuple | list):
        return ",".join(_text(x) for x in v) if v else "-"
    s = str(v)
    return repr(s) if (" " in s or not s) else s
