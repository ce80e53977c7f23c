"""The run's headline figures, each defined once with the label every view prints (pure).

The summary (`workflows/summary.py`), `rolledger status` and `rolledger replay` (`workers/progress.status_table`) and
the live progress line of `rolledger run` all take their reward pair and their words for admission pauses from here,
so the numbers a person reads in one place are the numbers they read in another.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from rolledger.schemas.statuses import AdmissionReason, RunStatus
from rolledger.workflows.state import RunState

EDGE_STEPS = 5  # reward_first / reward_last average this many trainer steps
REWARD_EDGES_LABEL = f"mean of the first/last {EDGE_STEPS} steps"  # what reward_first -> reward_last are, everywhere


def reward_edges(rewards: Sequence[float]) -> tuple[float, float] | None:
    """(reward_first, reward_last): the mean reward of the first and of the last `EDGE_STEPS` trainer steps (each
    step's reward is the mean over its batch). With fewer steps the two windows overlap (3 steps: both are the mean
    of all 3). None before the first step: there is no reward yet."""
    if not rewards:
        return None
    return statistics.fmean(rewards[:EDGE_STEPS]), statistics.fmean(rewards[-EDGE_STEPS:])


def format_reward_edges(rewards: Sequence[float]) -> str:
    """`0.537 -> 0.645`, or `-` before the first step (never `nan`)."""
    edges = reward_edges(rewards)
    return "-" if edges is None else f"{edges[0]:.3f} -> {edges[1]:.3f}"


# Why admission is not admitting, in words. The trainer setting the pace (the lag cap, the rate throttle, the byte
# cap) is the normal state of a run whose generation is faster than its training, and an update or a colocated
# handoff is a phase of every step: neither is an alarm. The coordinator's manual pause closes admission at the end
# of a run (last step, cancel) and for a halt: only the halt is an alarm.
TRAINER_PACE: dict[AdmissionReason, str] = {
    AdmissionReason.LAG: "lag cap",
    AdmissionReason.RATE: "rate throttle",
    AdmissionReason.BYTES: "byte cap",
}
PHASES: dict[AdmissionReason, str] = {
    AdmissionReason.UPDATE: "weight update in progress",
    AdmissionReason.HANDOFF: "engines handed to the trainer (colocated)",
}


def _manual(state: RunState) -> tuple[str, bool]:
    """The manual pause in words: the run's end (not an alarm) or a halt (an alarm)."""
    cfg = state.config
    if state.status == RunStatus.COMPLETED or (
        state.status == RunStatus.RUNNING and cfg is not None and state.trainer.step >= cfg.steps
    ):
        return "closed: the run reached its last step", False
    if state.status in (RunStatus.CANCELLED, RunStatus.ABORTED):
        return "closed: the run was stopped", False
    why = f" ({state.trainer.refused})" if state.trainer.refused else ""
    return f"PAUSED: run halted{why}", True


def admission_words(state: RunState) -> tuple[str, bool]:
    """What admission is doing, in words, and whether it is an alarm.

    ("open", False); ("waiting for the trainer (lag cap, rate throttle)", False) while only the trainer's pace holds
    it, as it does nearly every step; ("weight update in progress", False) for an update or a handoff (joined by
    "; " when several hold); ("closed: the run reached its last step", False) at the end; ("PAUSED: run halted",
    True) only for a halt."""
    paused = state.admission.paused
    if not paused:
        return "open", False
    pace = [TRAINER_PACE[r] for r in paused if r in TRAINER_PACE]
    words = [f"waiting for the trainer ({', '.join(pace)})"] if pace else []
    words += [PHASES[r] for r in paused if r in PHASES]
    alarm = False
    if AdmissionReason.MANUAL in paused:
        manual, alarm = _manual(state)
        words.insert(0, manual)
    words += [str(r) for r in paused if r not in TRAINER_PACE and r not in PHASES and r != AdmissionReason.MANUAL]
    return "; ".join(words), alarm


def format_bytes(n: int) -> str:
    """A byte count a person reads at a glance: 812 B, 5.2 kB, 47.0 MB."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"  # pragma: no cover - the loop returns
