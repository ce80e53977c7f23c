"""The auditor's state as it folds the log: what each unit, rank and update window has seen so far, and the
helpers every invariant's handlers share (recording a violation or warning, the update window, terminal events).
The handlers are in audit_groups, audit_samples and audit_updates; the driver is audit."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rolledger.schemas.config import RunConfig
from rolledger.schemas.events import (
    Event,
    SampleFinished,
    UpdateStaged,
)
from rolledger.schemas.trajectory import Trajectory
from rolledger.workflows.audit_attempts import UpdateTracker
from rolledger.workflows.audit_report import AuditWarning, Violation, WarningKind


@dataclass
class Unit:
    """A dispatched sample: its start and terminal event."""

    start: Event
    terminal: Event | None = None


@dataclass
class GroupUnit:
    """An admitted group: admission, terminal, completion and consumption."""

    admitted: Event
    terminal: Event | None = None
    completed: Event | None = None
    consumed: Event | None = None


@dataclass
class RankFacts:
    """What a rank holds: its version and weights, and since when."""

    version: int
    digest: str
    event: Event
    quarantined: Event | None = None
    invalidations: list[Event] = field(default_factory=list)  # since the rank (re)joined


@dataclass
class Window:
    """An update's window: from its pause (or commit) to its publish or abort."""

    opened_by: Event
    version: int | None
    committed: Event | None = None


def ids(*events: Event | None) -> tuple[str, ...]:
    """The distinct ids of the events given (None skipped), in order."""
    out: list[str] = []
    for e in events:
        if e is not None and e.event_id not in out:
            out.append(e.event_id)
    return tuple(out)


def span_versions(t: Trajectory) -> list[tuple[int, str]]:
    """(version, weights digest) of every stretch of tokens: the spans, or the whole trajectory."""
    return [(s.policy_version, s.weights_digest) for s in t.spans] or [(t.policy_version, t.weights_digest)]


class Auditor:
    """The fold's context: everything the invariants need from the events seen so far."""

    def __init__(self) -> None:
        self.quarantined_in: dict[int, set[int]] = {}
        self.stopped: dict[int, Event] = {}  # rank -> the EnginePaused/EngineSlept that stopped its generation
        self.marked: list[Event] = []  # every event with an append mark, duplicates included (audit.lost_appends)
        self.violations: list[Violation] = []
        self.warnings: list[AuditWarning] = []
        self.checked: Counter[int] = Counter()
        self.config: RunConfig | None = None
        self.run_started: Event | None = None
        self.run_finished: Event | None = None
        self.run_id: str | None = None
        self.count = 0
        self.seen: dict[str, Event] = {}  # every event id of the whole log: duplicates are found however far apart
        self.after_end: list[Event] = []  # events appended after RunFinished
        self.max_id_by_producer: dict[str, str] = {}
        self.groups: dict[str, GroupUnit] = {}
        self.samples: dict[str, Unit] = {}
        self.finished: dict[str, Event] = {}  # trajectory id -> SampleFinished
        self.sample_bytes: dict[str, int] = {}  # trajectory id -> bytes it holds while queued, recomputed
        self.consumed: dict[str, Event] = {}  # trajectory id -> BatchConsumed
        self.queued: dict[str, int] = {}  # completed, untrained group -> bytes, recomputed from its trajectories
        self.bounded_admission = False  # the run admits at max_tokens bounds: the queue never exceeds the cap
        self.updates = UpdateTracker()
        self.window: Window | None = None
        self.published: dict[int, Event] = {}  # version -> PolicyPublished (newest)
        self.version_digest: dict[int, str] = {}
        # the trainer's newest UpdateStaged (event, payload): what its next version descends from
        self.last_staged: tuple[Event, UpdateStaged] | None = None
        self.current_version = 0
        self.ranks: dict[int, RankFacts] = {}
        self.last_event: Event | None = None
        self.order: dict[str, int] = {}  # event id -> position of its first occurrence in the log
        self.warned_no_start = False

    def violate(self, invariant: int, message: str, *events: Event | None) -> None:
        self.violations.append(Violation(invariant, message, ids(*events)))

    def warn(self, kind: WarningKind, message: str, *events: Event | None, invariant: int | None = None) -> None:
        self.warnings.append(AuditWarning(kind, message, ids(*events), invariant))

    @property
    def cfg(self) -> RunConfig:
        if self.config is None:
            self.config = RunConfig()
        return self.config

    def in_window(self, e: Event, what: str) -> None:
        self.checked[2] += 1
        w = self.window
        if w is not None:
            target = f"update to v{w.version}" if w.version is not None else "an update"
            self.violate(
                2,
                f"{what} during {target}: window opened by {w.opened_by.type} {w.opened_by.event_id} "
                "and not yet closed by PolicyPublished/UpdateAborted",
                w.opened_by,
                e,
            )

    def close_window(self, version: int) -> None:
        if self.window is not None and self.window.version in (None, version):
            self.window = None

    def index(self, e: Event) -> int:
        return self.order.get(e.event_id, -1)

    def terminal(self, unit: Unit | GroupUnit, e: Event, name: str) -> None:
        if unit.terminal is not None:
            self.warn(
                WarningKind.DUPLICATE,
                f"{name} reached a second terminal event {e.type} after {unit.terminal.type}",
                unit.terminal,
                e,
                invariant=7,
            )
            return
        unit.terminal = e

    def trajectory(self, tid: str) -> Trajectory:
        p = self.finished[tid].payload
        assert isinstance(p, SampleFinished)
        return p.trajectory

    def finished_in(self, tid: str, gid: str) -> bool:
        return tid in self.finished and self.trajectory(tid).group_id == gid
