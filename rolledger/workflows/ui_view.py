"""What `rolledger ui` shows of one run, as JSON-able data built from its events alone (pure: no I/O, no clock).

`RunView` is fed the log event by event (`add`, in log order; a live run's new entries as they arrive) and answers
the page's questions: `status()` (the folded state: status, step/steps, version, reward, agreement, updates and
their outcomes), `timeline()` (`workflows.timeline.build_timeline`'s lanes, the lag histogram and the queue),
`curves()` (reward and logprob agreement per trainer step), `events(EventFilter)` (one row per event, filtered by
type, group, rank and version) and `lineage(id)` (`workflows.lineage.lineage`, for a trajectory or a group).
Serving it over HTTP is `rolledger.workers.operator.ui_server`'s job.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rolledger.schemas import events as ev
from rolledger.workflows.lineage import lineage
from rolledger.workflows.reducer import fold
from rolledger.workflows.state import RunState, UpdateState
from rolledger.workflows.timeline import Timeline, build_timeline

GROUP_LABEL = "group "  # build_timeline labels a generate span "group <group id>"
_SKIPPED_FIELDS = {"type", "config", "prompt_token_ids", "trajectory", "answer", "sampling", "partial_policy"}


@dataclass(frozen=True)
class EventFilter:
    """The event list's filters; None (or an empty set of types) lets everything through."""

    types: frozenset[str] = frozenset()
    group: str | None = None
    rank: int | None = None
    version: int | None = None


@dataclass(frozen=True)
class EventFacts:
    """What the filters and the list look at in one event: its groups, ranks, version and trajectories."""

    groups: tuple[str, ...]
    ranks: tuple[int, ...]
    version: int  # the payload's version where it names one, else the envelope's policy version
    trajectories: tuple[str, ...]

    def matches(self, f: EventFilter, event_type: str) -> bool:
        return (
            (not f.types or event_type in f.types)
            and (f.group is None or f.group in self.groups)
            and (f.rank is None or f.rank in self.ranks)
            and (f.version is None or f.version == self.version)
        )


def event_facts(e: ev.Event) -> EventFacts:
    p = e.payload
    groups: list[str] = []
    ranks: list[int] = []
    trajectories: list[str] = []
    version = e.policy_version
    if isinstance(p, ev.SampleFinished):
        t = p.trajectory
        groups.append(t.group_id)
        ranks.append(t.rank)
        trajectories.append(t.trajectory_id)
        version = t.policy_version
    group_id = getattr(p, "group_id", None)
    if isinstance(group_id, str):
        groups.append(group_id)
    groups.extend(getattr(p, "group_ids", ()))
    rank = getattr(p, "rank", None)
    if isinstance(rank, int):
        ranks.append(rank)
    for name in ("ranks", "failed_ranks"):
        ranks.extend(getattr(p, name, ()))
    sample_id = getattr(p, "sample_id", None)
    if isinstance(sample_id, str):
        trajectories.append(sample_id)
    trajectories.extend(getattr(p, "trajectory_ids", ()))
    if isinstance(p, ev.GroupCompleted):
        trajectories.extend(p.accepted)
    for name in ("version", "policy_version"):
        value = getattr(p, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            version = value
            break
    return EventFacts(
        tuple(dict.fromkeys(groups)), tuple(sorted(set(ranks))), version, tuple(dict.fromkeys(trajectories))
    )


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        items = [_short(v) for v in value[:6]]
        return "[" + ", ".join(items) + (", ..." if len(value) > 6 else "") + "]"
    text = str(value)
    return text if len(text) <= 120 else text[:117] + "..."


def event_detail(e: ev.Event) -> str:
    """The few fields of an event a person reads: scalars and short lists, digests cut to 12 characters."""
    p = e.payload
    if isinstance(p, ev.RunStarted):
        c = p.config
        return f"steps={c.steps} ranks={c.ranks} mode={c.mode} engine={c.engine} seed={c.seed}"
    if isinstance(p, ev.SampleFinished):
        t = p.trajectory
        line = (
            f"trajectory={t.trajectory_id} rank={t.rank} v{t.policy_version} tokens={len(t.token_ids)} "
            f"finish={t.finish_reason} gen_ms={p.gen_ms:.1f}"
        )
        if t.turns:  # an episode: each turn's source and its tokens
            line += " turns=" + " ".join(f"{turn.source}[{turn.start},{turn.end})" for turn in t.turns)
        return line
    parts = []
    for name in p.__struct_fields__:
        value = getattr(p, name)
        if name in _SKIPPED_FIELDS or value is None or value == "" or value == ():
            continue
        if name.endswith("digest") and isinstance(value, str):
            value = value[:12]
        parts.append(f"{name}={_short(value)}")
    return " ".join(parts)


@dataclass
class RunView:
    """The run as its log says so far; `add` each entry in log order."""

    state: RunState = field(default_factory=RunState)
    events: list[ev.Event] = field(default_factory=list)
    stream_ids: list[str] = field(default_factory=list)
    facts: list[EventFacts] = field(default_factory=list)
    finish_reason: str = ""
    undecodable: int = 0  # entries of the log that are not events (counted by whoever reads the log)
    # every closed update's row as it closed: the state keeps only the records a decider still reads
    closed_updates: dict[int, dict[str, Any]] = field(default_factory=dict)
    _timeline: tuple[int, Timeline] | None = None  # (events folded, the timeline of them)

    def add(self, stream_id: str, e: ev.Event) -> None:
        fold(self.state, e)
        p = e.payload
        if isinstance(p, ev.UpdateAborted | ev.PolicyPublished) and (u := self.state.updates.get(p.version)):
            self.closed_updates[p.version] = _update_row(u)
        self.events.append(e)
        self.stream_ids.append(stream_id)
        self.facts.append(event_facts(e))
        if isinstance(e.payload, ev.RunFinished):
            self.finish_reason = e.payload.reason

    @property
    def cursor(self) -> str:
        """Changes whenever the view does: the number of entries read (events and undecodable ones)."""
        return str(len(self.events) + self.undecodable)

    @property
    def t0(self) -> float:
        return self.events[0].wall_time if self.events else 0.0

    def status(self) -> dict[str, Any]:
        s = self.state
        cfg = s.config
        gaps = s.trainer.logprob_gaps
        rewards = s.trainer.rewards
        rows = {**self.closed_updates, **{v: _update_row(u) for v, u in s.updates.items()}}
        updates = [rows[v] for v in sorted(rows)]
        return {
            "run_id": s.run_id or (self.events[0].run_id if self.events else ""),
            "status": str(s.status),
            "finished": s.status.is_terminal,
            "reason": self.finish_reason,
            "step": s.trainer.step,
            "steps": cfg.steps if cfg else 0,
            "mode": cfg.mode if cfg else "",
            "engine": cfg.engine if cfg else "",
            "ranks": [
                {"rank": r.rank, "status": str(r.status), "version": r.committed_version, "groups": r.groups_generated}
                for _, r in sorted(s.ranks.items())
            ],
            "version": s.policy_version,
            "reward_first": rewards[0] if rewards else None,
            "reward_last": rewards[-1] if rewards else None,
            "agreement_last": gaps[-1] if gaps else None,
            "agreement_steps": len(gaps),
            "lag": s.lag,
            "max_lag": s.trainer.max_lag,
            "queued_bytes": s.admission.queued_bytes,
            "admission": "open" if s.admission.open else "paused: " + ", ".join(map(str, s.admission.paused)),
            "groups_admitted": s.admission.admitted,
            "groups_inflight": s.admission.inflight,
            "updates": updates,
            "published": s.updates_published,
            "aborted": s.updates_aborted,
            "events": len(self.events),
            "undecodable": self.undecodable,
            "anomalies": [{"event_id": a.event_id, "type": a.event_type, "message": a.message} for a in s.anomalies],
            "duration": (s.last_wall_time - s.first_wall_time) if self.events else 0.0,
            "last_stream_id": self.stream_ids[-1] if self.stream_ids else None,
        }

    def _built_timeline(self) -> Timeline:
        if self._timeline is None or self._timeline[0] != len(self.events):
            self._timeline = (len(self.events), build_timeline(self.events))
        return self._timeline[1]

    def timeline(self) -> dict[str, Any]:
        tl = self._built_timeline()
        spans = []
        for sp in tl.spans:
            span: dict[str, Any] = {
                "row": sp.row,
                "start": sp.start,
                "end": sp.end,
                "kind": sp.kind,
                "label": sp.label,
            }
            if sp.kind == "generate" and sp.label.startswith(GROUP_LABEL):
                span["group"] = sp.label.removeprefix(GROUP_LABEL)
            spans.append(span)
        return {
            "run_id": tl.run_id,
            "rows": tl.rows,
            "spans": spans,
            "duration": tl.duration,
            "lag_histogram": [[lag, n] for lag, n in sorted(tl.lag_histogram.items())],
            "queued": [[t, q] for t, q in tl.queued],
        }

    def curves(self) -> dict[str, Any]:
        """One point per trainer step: reward mean, loss, and the logprob gap where the step had on-policy tokens."""
        steps = []
        for e in self.events:
            p = e.payload
            if isinstance(p, ev.TrainStepFinished):
                steps.append(
                    {
                        "step": p.step,
                        "t": e.wall_time - self.t0,
                        "reward": p.reward_mean,
                        "loss": p.loss,
                        "gap_median": p.logprob_gap_median if p.agreement_tokens else None,
                        "gap_p99": p.logprob_gap_p99 if p.agreement_tokens else None,
                        "agreement_tokens": p.agreement_tokens,
                    }
                )
        return {"steps": steps}

    def event_row(self, i: int) -> dict[str, Any]:
        e, f = self.events[i], self.facts[i]
        return {
            "i": i,
            "stream_id": self.stream_ids[i],
            "event_id": e.event_id,
            "t": e.wall_time - self.t0,
            "type": e.type,
            "producer": e.producer,
            "version": f.version,
            "groups": list(f.groups),
            "ranks": list(f.ranks),
            "trajectories": list(f.trajectories[:8]),
            "detail": event_detail(e),
        }

    def events_page(self, f: EventFilter, limit: int = 500) -> dict[str, Any]:
        """The newest `limit` events that pass `f`, in log order, and how many passed."""
        matched = [i for i, facts in enumerate(self.facts) if facts.matches(f, self.events[i].type)]
        shown = matched[-limit:] if limit > 0 else []
        types: dict[str, int] = {}
        for e in self.events:
            types[e.type] = types.get(e.type, 0) + 1
        return {
            "total": len(self.events),
            "matched": len(matched),
            "types": dict(sorted(types.items())),
            "rows": [self.event_row(i) for i in shown],
        }

    def trajectories_of(self, group_id: str) -> list[str]:
        """The finished trajectories of a group, by sample index."""
        found = [
            (e.payload.trajectory.index, e.payload.trajectory.trajectory_id)
            for e in self.events
            if isinstance(e.payload, ev.SampleFinished) and e.payload.trajectory.group_id == group_id
        ]
        return [tid for _, tid in sorted(set(found))]

    def lineage(self, ref: str) -> dict[str, Any]:
        """The lineage of trajectory `ref`, or of the first finished trajectory of group `ref`; a KeyError naming
        `ref` if the log has neither."""
        admitted = (e.payload.group_id for e in self.events if isinstance(e.payload, ev.GroupAdmitted))
        if ref in self.state.groups or any(gid == ref for gid in admitted):  # live, or retired from the live state
            siblings = self.trajectories_of(ref)
            if not siblings:
                raise KeyError(f"group {ref!r} has no finished trajectory in the log")
            chain = lineage(self.events, siblings[0])
        else:
            chain = lineage(self.events, ref)
        group = chain.group.group_id
        return {
            "trajectory_id": chain.trajectory_id,
            "group_id": group,
            "siblings": self.trajectories_of(group),
            "lineage": chain.to_dict(),
            "text": chain.render(),
        }


def _update_row(u: UpdateState) -> dict[str, Any]:
    return {
        "version": u.version,
        "status": str(u.status),
        "reason": u.abort_reason,
        "failed_ranks": sorted(u.failed),
        "ranks": list(u.ranks),
    }


def view_of(entries: Iterable[tuple[str, ev.Event]]) -> RunView:
    """A view of a whole log at once (stream id, event) in log order."""
    v = RunView()
    for sid, e in entries:
        v.add(sid, e)
    return v


def parse_filter(query: dict[str, list[str]]) -> EventFilter:
    """The filter from a query string's parameters (`type` repeated or comma-separated, `group`, `rank`,
    `version`); a rank or version that is not an integer is a ValueError naming it."""

    def one(name: str) -> str | None:
        values = [v.strip() for v in query.get(name, []) if v.strip()]
        return values[-1] if values else None

    def integer(name: str) -> int | None:
        raw = one(name)
        if raw is None:
            return None
        try:
            return int(raw.removeprefix("v"))
        except ValueError:
            raise ValueError(f"{name} must be an integer, not {raw!r}") from None

    types = frozenset(t.strip() for raw in query.get("type", []) for t in raw.split(",") if t.strip())
    return EventFilter(types=types, group=one("group"), rank=integer("rank"), version=integer("version"))
