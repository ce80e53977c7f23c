"""What the timeline's PNG and HTML share: the Okabe-Ito palette and the legend of span kinds, the panel titles, the
lanes' names, the summary line, and the axis helpers (round ticks, the agreement panel's log floor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rolledger.workflows.timeline import SpanKind, StepPoint, Timeline, UpdateOutcome

# Okabe & Ito's colour-blind safe palette; idle is a light grey, paused a reddish purple: never two greys.
COLORS: dict[SpanKind, str] = {
    "generate": "#0072B2",
    "bubble": "#DADADA",
    "train": "#E69F00",
    "prepare": "#56B4E9",
    "commit": "#009E73",
    "abort": "#D55E00",
    "paused": "#CC79A7",
    "asleep": "#404040",
}
LEGEND: dict[SpanKind, str] = {
    "generate": "generating a group",
    "bubble": "rank idle (bubble)",
    "asleep": "rank asleep",
    "paused": "admission paused",
    "train": "train step",
    "prepare": "update: prepare",
    "commit": "update: commit → published",
    "abort": "update aborted",
}
REWARD_COLOR, MEDIAN_COLOR, P99_COLOR, QUEUE_COLOR, LAG_COLOR = "#0072B2", "#009E73", "#E69F00", "#444444", "#56B4E9"
TIME_LABEL = "seconds since run start"
PANEL_TITLES = (
    "what ran when",
    "groups waiting for the trainer",
    "reward per train step",
    "logprob agreement per step",
    "lag of consumed groups",
)


# ---------------------------------------------------------------------------------------------------- shared pieces
def lane_name(row: str) -> str:
    """The lane's label: "admission: lag" reads "admission paused: lag", "updates" reads "weight updates"."""
    if row.startswith("admission: "):
        return "admission paused: " + row.removeprefix("admission: ")
    return {"updates": "weight updates", "trainer": "trainer"}.get(row, row)


def summary_line(tl: Timeline) -> str:
    trained = [s for s in tl.steps if not s.refused]
    refused = len(tl.steps) - len(trained)
    counts = {o: sum(u.outcome == o for u in tl.updates) for o in ("published", "aborted", "open")}
    parts = [f"{tl.duration:.2f} s", f"{len(trained)} train steps"]
    if refused:
        parts.append(f"{refused} refused")
    parts.append(f"updates: {counts['published']} published, {counts['aborted']} aborted")
    if counts["open"]:
        parts.append(f"{counts['open']} open")
    if trained:
        parts.append(f"reward {trained[0].reward_mean:.3f} (step {trained[0].step}) → {trained[-1].reward_mean:.3f}")
    return " · ".join(parts)


def gap_floor(steps: Sequence[StepPoint]) -> float:
    """Where the agreement panel's log axis starts: a decade under the smallest positive gap; an exact 0 sits here."""
    positive = [g for s in steps if s.measured for g in (s.gap_median, s.gap_p99) if g > 0 and math.isfinite(g)]
    return 10 ** (math.floor(math.log10(min(positive))) - 1) if positive else 1e-9


def nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """About `n` round ticks (1, 2, 5 x 10^k apart) covering [lo, hi]."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step + 1e-9) + 1)]


def aborted_steps(tl: Timeline) -> list[UpdateOutcome]:
    return [u for u in tl.updates if u.outcome == "aborted" and u.step is not None]
