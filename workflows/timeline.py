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


def build_timeline(events: Iterable[ev.Event]) -> Timeline:
    tl = Timeline()
    t0: float | None = None
    group_start: dict[str, tuple[int, float]] = {}
    group_end: dict[str, float] = {}
    prepare_start: dict[int, float] = {}
    prepared_end: dict[int, float] = {}
    pause_start: dict[str, float] = {}
    update_pause: dict[int, float] = {}
    sleep_start: dict[int, tuple[int, float]] = {}
    last = 0.0
    queue = 0
    for e in events:
        if t0 is None:
            t0 = e.wall_time
            tl.run_id = e.run_id
            tl.rows.extend(["trainer", "updates"])
        t = e.wall_time - t0
        last = max(last, t)
        p = e.payload
        if isinstance(p, ev.GroupCompleted):
            queue += 1
            tl.queued.append((t, queue))
        elif isinstance(p, ev.BatchConsumed):
            queue -= len(p.group_ids)
            tl.queued.append((t, queue))
            for lag in p.lags:
                tl.lag_histogram[lag] = tl.lag_histogram.get(lag, 0) + 1
        elif isinstance(p, ev.TrajectoryDropped):
            queue -= 1
            tl.queued.append((t, queue))
        if isinstance(p, ev.SampleStarted) and p.group_id not in group_start:
            group_start[p.group_id] = (p.rank, t)
        elif isinstance(p, (ev.SampleFinished, ev.SampleCancelled, ev.SampleFailed)):
            gid = p.trajectory.group_id if isinstance(p, ev.SampleFinished) else p.group_id
            group_end[gid] = t
        elif isinstance(p, ev.TrainStepFinished):
            tl.add(
                "trainer",
                t - p.train_ms / 1e3,
                t,
                "train",
                f"step {p.step}: reward {p.reward_mean:.3f}, loss {p.loss:.3f}",
            )
        elif isinstance(p, ev.PrepareRequested):
            prepare_start[p.version] = t
        elif isinstance(p, ev.RankPrepared):
            prepared_end[p.version] = t
        elif isinstance(p, ev.AdmissionPaused):
            pause_start.setdefault(p.reason, t)
            if p.reason == "update":
                update_pause[max(prepare_start, default=0)] = t
        elif isinstance(p, ev.AdmissionResumed) and p.reason in pause_start:
            tl.add(f"admission: {p.reason}", pause_start.pop(p.reason), t, "paused", f"admission paused: {p.reason}")
        elif isinstance(p, (ev.PolicyPublished, ev.UpdateAborted)):
            v = p.version
            if v in prepare_start:
                tl.add("updates", prepare_start[v], prepared_end.get(v, t), "prepare", f"v{v} prepare")
            kind = "commit" if isinstance(p, ev.PolicyPublished) else "abort"
            label = f"v{v} published" if kind == "commit" else f"v{v} aborted: {p.reason}"  # type: ignore[union-attr]
            tl.add("updates", update_pause.get(v, prepared_end.get(v, t)), t, kind, label)
        elif isinstance(p, ev.EngineSlept):
            sleep_start[p.rank] = (p.level, t)
        elif isinstance(p, ev.EngineWoke) and p.rank in sleep_start and "kv_cache" in p.tags:
            level, since = sleep_start.pop(p.rank)
            tl.add(f"rank {p.rank}", since, t, "asleep", f"asleep (level {level})")
    for reason, start in pause_start.items():
        tl.add(f"admission: {reason}", start, last, "paused", f"admission paused: {reason}")
    per_rank: dict[int, list[tuple[float, float, str]]] = {}
    for gid, (rank, start) in group_start.items():
        per_rank.setdefault(rank, []).append((start, group_end.get(gid, last), gid))
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
