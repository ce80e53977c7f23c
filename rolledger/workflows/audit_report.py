"""The audit's report: the invariants it checks, each violation and warning, and how they are shown (text, JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

LOG_INTEGRITY = 0  # the pseudo-invariant of the log itself: whole, decodable, nothing after its end

INVARIANTS: dict[int, str] = {
    LOG_INTEGRITY: "the log is whole: every decision decodes, no acknowledged append missing, no event after "
    "RunFinished",
    1: "no sample holds tokens from two policy versions (unless interruptible, and then each span is stamped)",
    2: "no admission and no generation between an update's pause and its PolicyPublished/UpdateAborted",
    3: "every UpdateCommitted is preceded by RankPrepared from every rank (same version and manifest); "
    "every UpdateAborted leaves every rank on the old version",
    4: "after PolicyPublished(v) every rank runs v with the published digest and the cache generation after v",
    5: "every consumed trajectory has lag <= the bound and its group satisfied the partial policy",
    6: "queued bytes never exceeded the byte cap at an admission",
    7: "every dispatched unit reached a terminal event",
    8: "replaying the log gives the same state digest twice and the digests recorded in snapshots",
    9: "every staged version was trained from the trainer's last staged version or the published one (lineage)",
    10: "every episode's turns cover its tokens in order, policy first; no environment token is trained on or has a "
    "logprob; every policy token has a version within the run's published ones",
}


class WarningKind(StrEnum):
    """What an AuditWarning is about."""

    OPEN = "open"  # a unit still in flight (the run is not finished)
    DUPLICATE = "duplicate"  # the same event (or terminal, or commit) twice
    CONFLICTING_DUPLICATE = "conflicting_duplicate"  # one event id naming two different events
    OUT_OF_ORDER = "out_of_order"  # one producer's ids going backwards
    ORPHAN = "orphan"  # an event about a unit the log never started
    RESTART = "restart"  # a sample started again before its first attempt ended
    PROVENANCE = "provenance"  # recorded provenance disagrees with the log
    MALFORMED = "malformed"  # an event out of place (before RunStarted, after RunFinished, another run's)
    UNRESOLVED_UPDATE = "unresolved_update"  # an update neither committed nor aborted, or committed and not published
    QUEUED_BYTES = "queued_bytes"  # the log's queued bytes above the cap at an admission
    INTERNAL = "internal"  # the auditor could not check an event
    UNDECODABLE = "undecodable"  # a log entry that is not an event (garbage, unknown type, newer schema)
    DEAD_LETTER = "dead_letter"  # an entry some consumer could not process and copied to the dead-letter stream
    UNFINISHED = "unfinished"  # the log has no RunFinished
    RACED_QUARANTINE = "raced_quarantine"  # a group started on untouched weights before the rank read its quarantine


# One sentence per kind, printed once above its warnings: what it means and why it is a warning, not a violation.
WARNING_MEANING: dict[WarningKind, str] = {
    WarningKind.OPEN: "work still in flight in a run that has not finished; it becomes a violation (7) only if "
    "RunFinished comes while it is still open.",
    WarningKind.DUPLICATE: "the same event (or the same terminal, consumption or commit) appears twice, as a retried "
    "append can leave it; every fold counts it once, so no invariant is affected.",
    WarningKind.CONFLICTING_DUPLICATE: "one event id names two different events; the first is kept and the second "
    "ignored, so look at which producer wrote the second.",
    WarningKind.OUT_OF_ORDER: "one producer's event ids (stamped when an event is created) go backwards in the log "
    "(the order of appends), though every thread that appends is a producer of its own (a rank's rollout slots are "
    "rank-N/sK): its host's clock stepped back, or two writers used one name (a log from before slots had their "
    "own names shows it too); the log's order is the truth, so nothing is mis-checked.",
    WarningKind.ORPHAN: "an event about a unit the log never started (such as a result for a group never admitted); it "
    "is not counted, and invariant 7 still checks every unit that was started.",
    WarningKind.RESTART: "a sample started again before its first attempt ended (a reclaimed or restarted rank redid "
    "it); the attempts are checked like any other.",
    WarningKind.PROVENANCE: "the provenance a trajectory records differs from what the log says; the log's account "
    "is the one checked.",
    WarningKind.MALFORMED: "an event out of place (before RunStarted, from another run, a second RunStarted); the "
    "audit assumes what it says and checks the rest.",
    WarningKind.UNRESOLVED_UPDATE: "an update neither committed nor aborted, or committed and not published, when "
    "the log ends; no rank served it unpublished, or invariants 2-4 would say so.",
    WarningKind.QUEUED_BYTES: "an old log (GroupAdmitted v1, admitted on an estimate): the completed untrained "
    "groups recomputed from the log hold more bytes than the cap; a newer log's admission bounds them, so there it "
    "is a violation of invariant 6.",
    WarningKind.INTERNAL: "the auditor could not check an event (a bug in the audit, not in the run); the rest of "
    "the log is still checked.",
    WarningKind.UNDECODABLE: "a log entry that is not an event this code can read (garbage, unknown type, newer "
    "schema); a decision would be a violation, a fact is reported and skipped.",
    WarningKind.DEAD_LETTER: "an entry some consumer could not process and set aside in the dead-letter stream; the "
    "log itself is unchanged, so read the reason.",
    WarningKind.UNFINISHED: "the log has no RunFinished (still running, or killed), so the verdict is UNFINISHED, "
    "not OK.",
    WarningKind.RACED_QUARANTINE: "a rank started a group after its quarantine for an aborted update was logged but "
    "before it read it, on the published weights it still held untouched; the samples are sound.",
}


class Verdict(StrEnum):
    """The headline of a report: OK only for a finished run whose every invariant holds."""

    OK = "OK"
    VIOLATED = "VIOLATED"  # at least one violation
    UNFINISHED = "UNFINISHED"  # no violation, but the run never finished: open work is not proven lost or done


@dataclass(frozen=True)
class Violation:
    """A broken invariant (1..8), what broke it, and the ids of the events involved."""

    invariant: int
    message: str
    event_ids: tuple[str, ...]


@dataclass(frozen=True)
class AuditWarning:
    """Something that breaks no invariant but deserves a look, of one WarningKind."""

    kind: WarningKind
    message: str
    event_ids: tuple[str, ...]
    invariant: int | None = None


@dataclass(frozen=True)
class AuditReport:
    violations: tuple[Violation, ...]
    warnings: tuple[AuditWarning, ...]
    checked: dict[int, int]  # invariant -> how many things were checked for it
    events: int = 0
    run_id: str | None = None
    run_finished: bool = False

    @property
    def ok(self) -> bool:
        """No invariant is violated (so far: see `passed` for a finished run)."""
        return not self.violations

    @property
    def verdict(self) -> Verdict:
        if self.violations:
            return Verdict.VIOLATED
        return Verdict.OK if self.run_finished else Verdict.UNFINISHED

    @property
    def passed(self) -> bool:
        """What `rolledger audit` exits 0 on: a finished run with no violation."""
        return self.verdict is Verdict.OK

    def for_invariant(self, invariant: int) -> tuple[Violation, ...]:
        return tuple(v for v in self.violations if v.invariant == invariant)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.passed,
            "verdict": str(self.verdict),
            "invariants_hold": self.ok,
            "run_id": self.run_id,
            "events": self.events,
            "run_finished": self.run_finished,
            "checked": {str(k): v for k, v in sorted(self.checked.items())},
            "violations": [asdict(v) for v in self.violations],
            "warnings": [asdict(w) for w in self.warnings],
            "warning_kinds": {str(k): WARNING_MEANING[k] for k in self.warning_kinds()},
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def render(self) -> str:
        """Human text: one line per invariant, then the violations and warnings."""
        lines = [f"audit of run {self.run_id or '?'}: {self.events} events, {self.verdict}"]
        if self.verdict is Verdict.UNFINISHED:
            lines.append(
                "  UNFINISHED: the log has no RunFinished (still running, or killed): units in flight are neither "
                "proven done nor lost, and invariant 7 is only checked at the end"
            )
        for inv in sorted(INVARIANTS):
            bad = len(self.for_invariant(inv))
            mark = "ok " if bad == 0 else "FAIL"
            lines.append(f"  [{mark}] {inv}. {INVARIANTS[inv]} ({self.checked.get(inv, 0)} checked, {bad} violated)")
        for v in self.violations:
            lines.append(f"  violation {v.invariant}: {v.message} [{', '.join(v.event_ids)}]")
        for kind in self.warning_kinds():
            of_kind = [w for w in self.warnings if w.kind == kind]
            lines.append(f"  {len(of_kind)} warning(s) {kind}: {WARNING_MEANING[kind]}")
            for w in of_kind:
                lines.append(f"  warning {w.kind}: {w.message} [{', '.join(w.event_ids)}]")
        return "\n".join(lines)

    def warning_kinds(self) -> list[WarningKind]:
        """The kinds of warning in this report, in the order they first occur."""
        return list(dict.fromkeys(w.kind for w in self.warnings))
