"""`rolledger timeline`: the picture of a run — per rank the groups it generated and the bubbles between them, the
trainer's steps, every weight update (prepare, then the paused window up to publish or abort), admission pauses by
reason, and sleep/wake handoffs; below, the lag histogram of consumed groups and the queue waiting for the trainer. Built from the log alone (`build_timeline` is pure); drawn as PNG (matplotlib) or
as a self-contained HTML page with an inline SVG whose spans have tooltips.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import AdmissionReason, WakeTag
from rolledger.workflows.dispatch import Handlers

COLORS = {
    "generate": "#4C9BE8",
    "bubble": "#E6E6E6",
    "train": "#F2A541",
    "prepare": "#9B8AE6",
    "commit": "#3DBE8B",
    "abort": "#E8574C",
    "paused": "#C7C7C7",
    "asleep": "#7A7A7A",
}


@dataclass(frozen=True)
class Span:
    row: str
    start: float  # seconds since the run started
    end: float
    kind: str  # a key of COLORS
    label: str


@dataclass
class Timeline:
    run_id: str = ""
    rows: list[str] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    duration: float = 0.0
    lag_histogram: dict[int, int] = field(default_factory=dict)  # consumed groups by lag (trained - generated version)
    queued: list[tuple[float, int]] = field(default_factory=list)  # (t, groups completed but not yet trained)

    def add(self, row: str, start: float, end: float, kind: str, label: str) -> None:
        if row not in self.rows:
            self.rows.append(row)
        self.spans.append(Span(row, start, max(end, start), kind, label))


@dataclass
class _Build:
    """build_timeline's fold: the timeline so far and the spans still open."""

    tl: Timeline
    t: float = 0.0  # seconds since the run started, of the event being folded
    queue: int = 0
    group_start: dict[str, tuple[int, float]] = field(default_factory=dict)
    group_end: dict[str, float] = field(default_factory=dict)
    prepare_start: dict[int, float] = field(default_factory=dict)
    prepared_end: dict[int, float] = field(default_factory=dict)
    pause_start: dict[str, float] = field(default_factory=dict)
    update_pause: dict[int, float] = field(default_factory=dict)
    sleep_start: dict[int, tuple[int, float]] = field(default_factory=dict)

    def queued(self, delta: int) -> None:
        self.queue += delta
        self.tl.queued.append((self.t, self.queue))


_BUILD: Handlers[_Build, None] = Handlers("timeline")


@_BUILD.on(ev.GroupCompleted)
def _group_completed(b: _Build, e: ev.Event, p: ev.GroupCompleted) -> None:
    b.queued(+1)


@_BUILD.on(ev.BatchConsumed)
def _batch_consumed(b: _Build, e: ev.Event, p: ev.BatchConsumed) -> None:
    b.queued(-len(p.group_ids))
    for lag in p.lags:
        b.tl.lag_histogram[lag] = b.tl.lag_histogram.get(lag, 0) + 1


@_BUILD.on(ev.TrajectoryDropped)
def _trajectory_dropped(b: _Build, e: ev.Event, p: ev.TrajectoryDropped) -> None:
    b.queued(-1)


@_BUILD.on(ev.SampleStarted)
def _sample_started(b: _Build, e: ev.Event, p: ev.SampleStarted) -> None:
    if p.group_id not in b.group_start:
        b.group_start[p.group_id] = (p.rank, b.t)


def _sample_ended(b: _Build, e: ev.Event, p: ev.SampleFinished | ev.SampleCancelled | ev.SampleFailed) -> None:
    gid = p.trajectory.group_id if isinstance(p, ev.SampleFinished) else p.group_id
    b.group_end[gid] = b.t


_BUILD.on(ev.SampleFinished)(_sample_ended)
_BUILD.on(ev.SampleCancelled)(_sample_ended)
_BUILD.on(ev.SampleFailed)(_sample_ended)


@_BUILD.on(ev.TrainStepFinished)
def _train_step(b: _Build, e: ev.Event, p: ev.TrainStepFinished) -> None:
    b.tl.add(
        "trainer", b.t - p.train_ms / 1e3, b.t, "train", f"step {p.step}: reward {p.reward_mean:.3f}, loss {p.loss:.3f}"
    )


@_BUILD.on(ev.PrepareRequested)
def _prepare_requested(b: _Build, e: ev.Event, p: ev.PrepareRequested) -> None:
    b.prepare_start[p.version] = b.t


@_BUILD.on(ev.RankPrepared)
def _rank_prepared(b: _Build, e: ev.Event, p: ev.RankPrepared) -> None:
    b.prepared_end[p.version] = b.t


@_BUILD.on(ev.AdmissionPaused)
def _admission_paused(b: _Build, e: ev.Event, p: ev.AdmissionPaused) -> None:
    b.pause_start.setdefault(p.reason, b.t)
    if p.reason == AdmissionReason.UPDATE:
        b.update_pause[max(b.prepare_start, default=0)] = b.t


@_BUILD.on(ev.AdmissionResumed)
def _admission_resumed(b: _Build, e: ev.Event, p: ev.AdmissionResumed) -> None:
    if p.reason in b.pause_start:
        b.tl.add(f"admission: {p.reason}", b.pause_start.pop(p.reason), b.t, "paused", f"admission paused: {p.reason}")


def _update_closed(b: _Build, e: ev.Event, p: ev.PolicyPublished | ev.UpdateAborted) -> None:
    v, t = p.version, b.t
    if v in b.prepare_start:
        b.tl.add("updates", b.prepare_start[v], b.prepared_end.get(v, t), "prepare", f"v{v} prepare")
    if isinstance(p, ev.PolicyPublished):
        kind, label = "commit", f"v{v} published"
    else:
        kind, label = "abort", f"v{v} aborted: {p.reason}"
    b.tl.add("updates", b.update_pause.get(v, b.prepared_end.get(v, t)), t, kind, label)


_BUILD.on(ev.PolicyPublished)(_update_closed)
_BUILD.on(ev.UpdateAborted)(_update_closed)


@_BUILD.on(ev.EngineSlept)
def _engine_slept(b: _Build, e: ev.Event, p: ev.EngineSlept) -> None:
    b.sleep_start[p.rank] = (p.level, b.t)


@_BUILD.on(ev.EngineWoke)
def _engine_woke(b: _Build, e: ev.Event, p: ev.EngineWoke) -> None:
    if p.rank in b.sleep_start and WakeTag.KV_CACHE in p.tags:
        level, since = b.sleep_start.pop(p.rank)
        b.tl.add(f"rank {p.rank}", since, b.t, "asleep", f"asleep (level {level})")


def build_timeline(events: Iterable[ev.Event]) -> Timeline:
    b = _Build(Timeline())
    tl = b.tl
    t0: float | None = None
    last = 0.0
    for e in events:
        if t0 is None:
            t0 = e.wall_time
            tl.run_id = e.run_id
            tl.rows.extend(["trainer", "updates"])
        b.t = e.wall_time - t0
        last = max(last, b.t)
        _BUILD.apply(b, e)
    for reason, start in b.pause_start.items():
        tl.add(f"admission: {reason}", start, last, "paused", f"admission paused: {reason}")
    per_rank: dict[int, list[tuple[float, float, str]]] = {}
    for gid, (rank, start) in b.group_start.items():
        per_rank.setdefault(rank, []).append((start, b.group_end.get(gid, last), gid))
    for rank, spans in sorted(per_rank.items()):
        spans.sort()
        prev = 0.0
        for start, end, gid in spans:
            if start > prev:  # bubbles go underneath: sleep spans drawn later cover them
                tl.spans.insert(0, Span(f"rank {rank}", prev, start, "bubble", f"idle {start - prev:.3f}s"))
            tl.add(f"rank {rank}", start, end, "generate", f"group {gid}")
            prev = max(prev, end)
    tl.duration = last
    tl.rows.sort(key=lambda r: (not r.startswith("rank"), r))
    return tl


def write_timeline(tl: Timeline, out: Path) -> None:
    if out.suffix == ".png":
        _png(tl, out)
    elif out.suffix in (".html", ".htm"):
        out.write_text(_html(tl))
    else:
        raise ValueError(f"timeline output must end in .png or .html, not {out.suffix!r}")


def _png(tl: Timeline, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig = plt.figure(figsize=(14, 3.6 + 0.6 * len(tl.rows)))
    grid = fig.add_gridspec(2, 2, height_ratios=[0.6 * len(tl.rows) + 1.0, 2.6], width_ratios=[1, 3])
    ax = fig.add_subplot(grid[0, :])
    lag_ax, queue_ax = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1], sharex=ax)
    lags = sorted(tl.lag_histogram)
    lag_ax.bar([str(k) for k in lags], [tl.lag_histogram[k] for k in lags], color="#4C9BE8")
    lag_ax.set_xlabel("lag of consumed groups (versions)")
    lag_ax.set_ylabel("groups")
    if tl.queued:
        xs, ys = zip(*tl.queued, strict=True)
        queue_ax.step(xs, ys, where="post", color="#F2A541")
    queue_ax.set_ylabel("groups waiting\nfor the trainer")
    queue_ax.set_xlabel("seconds since RunStarted")
    index = {r: i for i, r in enumerate(tl.rows)}
    for s in tl.spans:
        ax.broken_barh(
            [(s.start, max(s.end - s.start, tl.duration / 2000))], (index[s.row] - 0.4, 0.8), color=COLORS[s.kind]
        )
    ax.set_yticks(range(len(tl.rows)))
    ax.set_yticklabels(tl.rows)
    ax.invert_yaxis()
    ax.set_title(f"rolledger timeline: {tl.run_id}", pad=30)
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in COLORS.items()],
        loc="lower center",
        bbox_to_anchor=(0.5, 1.04),
        ncol=len(COLORS),
        fontsize="small",
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _html(tl: Timeline) -> str:
    width, row_h, left = 1200, 28, 90
    height = row_h * len(tl.rows) + 40
    scale = (width - left - 10) / max(tl.duration, 1e-9)
    index = {r: i for i, r in enumerate(tl.rows)}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">'
    ]
    for r, i in index.items():
        parts.append(f'<text x="4" y="{i * row_h + 18}">{html.escape(r)}</text>')
    for s in tl.spans:
        x = left + s.start * scale
        w = max((s.end - s.start) * scale, 0.5)
        y = index[s.row] * row_h + 4
        parts.append(
            f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h - 8}" fill="{COLORS[s.kind]}">'
            f"<title>{html.escape(s.label)} ({s.start:.3f}s to {s.end:.3f}s)</title></rect>"
        )
    parts.append(
        f'<text x="{left}" y="{height - 8}">0 s</text><text x="{width - 60}" y="{height - 8}">{tl.duration:.2f} s</text>'
    )
    parts.append("</svg>")
    most = max(tl.lag_histogram.values(), default=1)
    lag_rows = "".join(
        f"<tr><td>{k}</td><td>{v}</td><td><div style='background:#4C9BE8;height:12px;width:{240 * v // most}px'></div></td></tr>"
        for k, v in sorted(tl.lag_histogram.items())
    )
    peak = max((q for _, q in tl.queued), default=0)
    below = (
        f"<h3>lag of consumed groups</h3><table cellpadding=3><tr><th>lag</th><th>groups</th><th></th></tr>{lag_rows}"
        f"</table><p>groups waiting for the trainer: peak {peak}</p>"
    )
    legend = " ".join(f'<span style="background:{c};padding:2px 6px;margin:2px">{k}</span>' for k, c in COLORS.items())
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>rolledger timeline {html.escape(tl.run_id)}</title></head>"
        f"<body><h2>rolledger timeline: {html.escape(tl.run_id)}</h2><p>{legend}</p>{''.join(parts)}{below}</body></html>\n"
    )
