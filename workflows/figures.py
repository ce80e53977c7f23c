"""The run's headline figures, each defined once with the label every view prints (pure).

The summary (`workflows/summary.py`), `rolledger status` and `rolledger replay` (`workers/progress.status_table`) and
the live progress line of `rolledger run` all take their reward pair and their words for admission pauses from here,
so the numbers a person reads in one place are the numbers they read in another.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from rolledger.schemas.statuses import AdmissionReason

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
# handoff is a phase of every step: neither is an alarm. Only a manual pause (a halt) is.
TRAINER_PACE: dict[AdmissionReason, str] = {
    AdmissionReason.LAG: "lag cap",
    AdmissionReason.RATE: "rate throttle",
    AdmissionReason.BYTES: "byte cap",
}
PHASES: dict[AdmissionReason, str] = {
    AdmissionReason.UPDATE: "weight update in progress",
    AdmissionReason.HANDOFF: "engines handed to the trainer (colocated)",
}


def admission_words(paused: Sequence[AdmissionReason]) -> tuple[str, bool]:
    """What admission is doing, in words, and whether it is an alarm.

    ("open", False); ("waiting for the trainer (lag cap, rate throttle)", False) while only the trainer's pace holds
    it, as it does nearly every step; ("weight update in progress", False) for an update or a handoff (both joined
    by "; " when both hold); ("PAUSED: run halted", True) once anything else holds it (a halt)."""
    if not paused:
        return "open", False
    pace = [TRAINER_PACE[r] for r in paused if r in TRAINER_PACE]
    words = [f"waiting for the trainer ({', '.join(pace)})"] if pace else []
    words += [PHASES[r] for r in paused if r in PHASES]
    other = [r for r in paused if r not in TRAINER_PACE and r not in PHASES]
    if other:
        halted = ", ".join("run halted" if r == AdmissionReason.MANUAL else str(r) for r in other)
        return "; ".join([f"PAUSED: {halted}", *words]), True
    return "; ".join(words), False


def format_bytes(n: int) -> str:
    """A byte count a person reads at a glance: 812 B, 5.2 kB, 47.0 MB."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"  # pragma: no cover - the loop returns
