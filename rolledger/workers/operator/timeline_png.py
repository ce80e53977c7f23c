"""The timeline as a PNG: a matplotlib Figure (no pyplot state; matplotlib is imported when a figure is drawn) with
the lanes, the queue, reward, agreement and the lag histogram, each panel titled with one of PANEL_TITLES.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rolledger.workers.operator.timeline_style import (
    COLORS,
    LAG_COLOR,
    LEGEND,
    MEDIAN_COLOR,
    P99_COLOR,
    PANEL_TITLES,
    QUEUE_COLOR,
    REWARD_COLOR,
    TIME_LABEL,
    aborted_steps,
    gap_floor,
    lane_name,
    summary_line,
)
from rolledger.workflows.timeline import Timeline, UpdateOutcome

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axis import XAxis, YAxis
    from matplotlib.figure import Figure


def timeline_figure(tl: Timeline) -> Figure:
    """The PNG's matplotlib Figure (no pyplot state): the lanes, the queue, reward, agreement and the lag histogram.
    Each panel's axes title is one of PANEL_TITLES."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = len(tl.rows)
    lanes_h = 0.42 * rows + 1.6
    fig = Figure(figsize=(15, lanes_h + 6.9), layout="constrained")
    grid = fig.add_gridspec(4, 3, height_ratios=[0.55, lanes_h, 1.7, 2.6], width_ratios=[1.2, 1.2, 0.8])
    header = fig.add_subplot(grid[0, :])
    lanes = fig.add_subplot(grid[1, :])
    queue = fig.add_subplot(grid[2, :], sharex=lanes)
    reward, agree, lag = (fig.add_subplot(grid[3, i]) for i in range(3))
    fig.suptitle(f"rolledger timeline · run {tl.run_id}", fontsize=15, fontweight="bold")
    header.axis("off")  # the summary and the legend, in an axes of their own so that the layout keeps them apart
    header.text(
        0.5, 1.0, summary_line(tl), ha="center", va="top", fontsize=10.5, color="#333333", transform=header.transAxes
    )
    kinds = {s.kind for s in tl.spans}
    handles = [
        Patch(facecolor=COLORS[k], label=label, hatch="xxx" if k == "abort" else None, edgecolor="white")
        for k, label in LEGEND.items()
        if k in kinds or k in ("generate", "paused", "train", "commit")
    ]
    header.legend(
        handles=handles,
        loc="lower center",
        bbox_to_anchor=(0.5, -0.1),
        ncol=len(handles),
        frameon=False,
        fontsize=9.5,
        handlelength=2.2,
    )
    _png_lanes(lanes, tl)
    _png_queue(queue, tl)
    _png_reward(reward, tl)
    _png_agreement(agree, tl)
    _png_lag(lag, tl)
    return fig


def _integer_ticks(axis: XAxis | YAxis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _png_lanes(ax: Axes, tl: Timeline) -> None:
    index = {r: i for i, r in enumerate(tl.rows)}
    duration = max(tl.duration, 1e-9)
    ax.set_title(PANEL_TITLES[0], loc="left", fontsize=11)
    thin, visible = duration / 2000, duration / 220
    for s in tl.spans:
        y = index[s.row]
        update = s.row == "updates"
        h = 0.5 if update else 0.76
        width = max(s.end - s.start, 2 * visible if s.kind == "abort" else visible if update else thin)
        ax.broken_barh(
            [(s.start, width)],
            (y - h / 2 - (0.2 if update else 0), h),
            facecolor=COLORS[s.kind],
            hatch="xxx" if s.kind == "abort" else None,
            edgecolor="white" if s.kind == "abort" else "none",
            linewidth=0,
        )
    for u in tl.updates:
        if u.outcome == "aborted":
            ax.axvline(u.end, color=COLORS["abort"], linewidth=1, linestyle=(0, (4, 3)), alpha=0.6, zorder=0)
    # lane groups: ranks | admission | trainer and updates
    for i in range(1, len(tl.rows)):
        if tl.rows[i].split()[0] != tl.rows[i - 1].split()[0] and "rank" in (tl.rows[i - 1].split()[0], "admission:"):
            ax.axhline(i - 0.5, color="#999999", linewidth=0.6)
    ax.set_yticks(range(len(tl.rows)), [lane_name(r) for r in tl.rows], fontsize=9.5)
    ax.set_ylim(len(tl.rows) + (0.1 if "updates" in index else -0.5), -0.6)
    ax.set_xlabel(TIME_LABEL)
    ax.xaxis.grid(True, color="#EEEEEE", linewidth=0.8)
    ax.set_axisbelow(True)
    ax.tick_params(axis="y", length=0)
    ax.set_xlim(-duration * 0.01, duration * 1.01)
    if "updates" in index:
        _png_update_labels(ax, tl, index["updates"], duration)
    if "trainer" in index:
        char = duration * 8 / 1450  # roughly one character of 8 pt text, in seconds
        for s in tl.spans:
            text = s.label.split(":")[0]
            if s.kind == "train" and (s.end - s.start) > char * (len(text) + 1):
                ax.text((s.start + s.end) / 2, index["trainer"], text, ha="center", va="center", fontsize=8)


def _png_update_labels(ax: Axes, tl: Timeline, y: int, duration: float) -> None:
    """Each update's label under its bar, on the first of two levels where it fits; an abort is always labelled,
    a published one falls back to "v3" and then to nothing when the run is too dense."""
    char = duration * 7.5 / 1450
    right = [-math.inf, -math.inf]
    for u in sorted(tl.updates, key=lambda u: u.start):
        texts = [u.label] if u.outcome == "aborted" else [u.label, f"v{u.version}"]
        placed = False
        for text in texts:
            for level in (0, 1):
                if u.start >= right[level]:
                    _png_update_label(ax, u, text, y + 0.35 + 0.42 * level)
                    right[level] = u.start + char * (len(text) + 2)
                    placed = True
                    break
            if placed:
                break
        if not placed and u.outcome == "aborted":
            level = 0 if right[0] <= right[1] else 1
            _png_update_label(ax, u, u.label, y + 0.35 + 0.42 * level)
            right[level] = max(right[level], u.start + char * (len(u.label) + 2))


def _png_update_label(ax: Axes, u: UpdateOutcome, text: str, y: float) -> None:
    aborted = u.outcome == "aborted"
    x = min(u.start, ax.get_xlim()[1] - (ax.get_xlim()[1] - ax.get_xlim()[0]) * 7.5 * len(text) / 1450)
    ax.text(
        x,
        y,
        text,
        ha="left",
        va="center",
        fontsize=7.5,
        color=COLORS["abort"] if aborted else "#222222",
        fontweight="bold" if aborted else "normal",
    )


def _png_queue(ax: Axes, tl: Timeline) -> None:
    ax.set_title(PANEL_TITLES[1] + " (completed, not yet trained)", loc="left", fontsize=11)
    if tl.queued:
        xs = [0.0] + [t for t, _ in tl.queued] + [tl.duration]
        ys = [0] + [q for _, q in tl.queued] + [tl.queued[-1][1]]
        ax.fill_between(xs, ys, step="post", color=QUEUE_COLOR, alpha=0.25, linewidth=0)
        ax.step(xs, ys, where="post", color=QUEUE_COLOR, linewidth=1.6)
    ax.set_ylabel("groups")
    ax.set_xlabel(TIME_LABEL)
    ax.set_ylim(bottom=0)
    _integer_ticks(ax.yaxis)
    ax.grid(True, color="#EEEEEE", linewidth=0.8)
    ax.set_axisbelow(True)


def _png_reward(ax: Axes, tl: Timeline) -> None:
    ax.set_title(PANEL_TITLES[2], loc="left", fontsize=11)
    trained = [s for s in tl.steps if not s.refused]
    if trained:
        ax.plot(
            [s.step for s in trained],
            [s.reward_mean for s in trained],
            color=REWARD_COLOR,
            marker="o",
            markersize=4,
            linewidth=1.6,
            label="mean reward of the batch",
        )
    for i, u in enumerate(aborted_steps(tl)):
        assert u.step is not None
        ax.axvline(
            u.step,
            color=COLORS["abort"],
            linestyle=(0, (4, 3)),
            linewidth=1,
            label="the step's update aborted" if i == 0 else None,
        )
        ax.text(
            u.step,
            0.02,
            f" v{u.version} aborted",
            transform=ax.get_xaxis_transform(),
            rotation=90,
            ha="left",
            va="bottom",
            fontsize=7.5,
            color=COLORS["abort"],
        )
    for s in tl.steps:
        if s.refused:
            ax.axvline(s.step, color="#000000", linestyle=":", linewidth=1)
    if tl.steps:
        ax.set_xlim(min(s.step for s in tl.steps) - 0.5, max(s.step for s in tl.steps) + 0.5)
    ax.set_xlabel("train step")
    ax.set_ylabel("mean reward")
    _integer_ticks(ax.xaxis)
    ax.grid(True, color="#EEEEEE", linewidth=0.8)
    if trained:
        ax.legend(fontsize=8, loc="best", frameon=False)
    else:
        ax.text(0.5, 0.5, "no train step yet", ha="center", va="center", transform=ax.transAxes, color="#777777")


def _png_agreement(ax: Axes, tl: Timeline) -> None:
    ax.set_title(PANEL_TITLES[3] + " |trainer − engine|", loc="left", fontsize=11)
    floor = gap_floor(tl.steps)
    measured = [s for s in tl.steps if s.measured]
    for attr, color, name in (("gap_median", MEDIAN_COLOR, "median gap"), ("gap_p99", P99_COLOR, "p99 gap")):
        xs = [s.step for s in measured]
        ys = [max(getattr(s, attr), floor) for s in measured]
        if xs:
            ax.plot(xs, ys, color=color, linewidth=1.2, alpha=0.7)
            ax.scatter(xs, ys, color=color, s=22, label=name, zorder=3)
    refused = [s for s in tl.steps if s.refused]
    if refused:
        ax.scatter(
            [s.step for s in refused],
            [max(s.gap_median, floor) for s in refused],
            marker="X",
            s=60,
            color="#000000",
            label="step refused",
            zorder=4,
        )
    tops = [g for s in measured + refused for g in (s.gap_median, s.gap_p99) if math.isfinite(g)]
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, max(tops + [floor]) * 300)  # headroom for the legend
    ax.axhline(floor, color="#999999", linewidth=0.8, linestyle=":")
    ax.text(
        0.99,
        floor,
        "exactly 0 ",
        transform=ax.get_yaxis_transform(),
        ha="right",
        va="top",
        fontsize=7.5,
        color="#666666",
    )
    if tl.steps:
        ax.set_xlim(min(s.step for s in tl.steps) - 0.5, max(s.step for s in tl.steps) + 0.5)
    ax.set_xlabel("train step (steps with no on-policy tokens are left out)")
    ax.set_ylabel("|Δ logprob| (nats)")
    _integer_ticks(ax.xaxis)
    ax.grid(True, color="#EEEEEE", linewidth=0.8, which="major")
    if measured or refused:
        ax.legend(fontsize=8, loc="upper left", frameon=False, ncol=3)
    else:
        ax.text(
            0.5, 0.5, "no step measured agreement", ha="center", va="center", transform=ax.transAxes, color="#777777"
        )


def _png_lag(ax: Axes, tl: Timeline) -> None:
    ax.set_title(PANEL_TITLES[4], loc="left", fontsize=11)
    lags = sorted(tl.lag_histogram)
    bars = ax.bar(lags, [tl.lag_histogram[k] for k in lags], color=LAG_COLOR, width=0.7)
    ax.bar_label(bars, fontsize=8)
    ax.set_xticks(lags or [0])
    ax.set_xlim(min(lags or [0]) - 1, max(lags or [0]) + 1)
    ax.set_xlabel("versions behind the trainer")
    ax.set_ylabel("groups")
    ax.margins(y=0.15)
    _integer_ticks(ax.yaxis)
