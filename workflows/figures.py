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


# Why admission is not admitting, in words. Flow control (the trainer sets the pace) is the normal state of a run
# whose generation is faster than its training; only a manual pause (a halt) is an alarm.
ADMISSION_WHY: dict[AdmissionReason, str] = {
    AdmissionReason.RATE: "2 batches already wait for the trainer",
    AdmissionReason.LAG: "generation is max_lag versions ahead of the trainer",
    AdmissionReason.BYTES: "the queue is at its byte cap",
    AdmissionReason.UPDATE: "a weight update is in progress",
    AdmissionReason.HANDOFF: "the engines are handed to the trainer (colocated)",
    AdmissionReason.MANUAL: "the run is halted",
}
FLOW_CONTROL: frozenset[AdmissionReason] = frozenset(
    {AdmissionReason.RATE, AdmissionReason.LAG, AdmissionReason.BYTES, AdmissionReason.UPDATE, AdmissionReason.HANDOFF}
)


def admission_words(paused: Sequence[AdmissionReason]) -> tuple[str, bool]:
    """What admission is doing, in words, and whether it is an alarm.

    Open: ("open", False). Held only by flow control (the rate throttle, the lag cap, the byte cap, an update or a
    handoff): ("waiting: <why>; <why>", False), which happens nearly every step and is how the trainer sets the
    pace. Anything else (a halt): ("PAUSED: <why>", True)."""
    if not paused:
        return "open", False
    why = "; ".join(ADMISSION_WHY.get(r, str(r)) for r in paused)
    alarm = any(r not in FLOW_CONTROL for r in paused)
    return (f"PAUSED: {why}" if alarm else f"waiting: {why}"), alarm


def format_bytes(n: int) -> str:
    """A byte count a person reads at a glance: 812 B, 5.2 kB, 47.0 MB."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"  # pragma: no cover - the loop returns
