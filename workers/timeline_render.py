"""Drawing a run's timeline (`rolledger timeline --out FILE`): PNG through matplotlib, or a self-contained HTML page
with an inline SVG whose spans have tooltips. The timeline itself is extracted, purely, by
`rolledger.workflows.timeline.build_timeline`; this module only renders it and writes the file.
"""

from __future__ import annotations

import html
from pathlib import Path

from rolledger.workflows.timeline import SpanKind, Timeline

SUFFIXES = (".png", ".html", ".htm")

COLORS: dict[SpanKind, str] = {
    "generate": "#4C9BE8",
    "bubble": "#E6E6E6",
    "train": "#F2A541",
    "prepare": "#9B8AE6",
    "commit": "#3DBE8B",
    "abort": "#E8574C",
    "paused": "#C7C7C7",
    "asleep": "#7A7A7A",
}


def write_timeline(tl: Timeline, out: Path) -> None:
    """Draw `tl` into `out`: PNG or HTML by its suffix (a ValueError for any other)."""
    if out.suffix == ".png":
        _png(tl, out)
    elif out.suffix in SUFFIXES:
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
