"""Drawing a run's timeline (`rolledger timeline --out FILE`): a PNG through matplotlib, or a self-contained HTML page
of inline SVG panels with axes, ticks and hover details (no CDN, no build step).

Both show the same panels: the lanes (per rank its groups and idle bubbles, admission pauses by reason, the trainer's
steps, weight updates labelled with their outcome, e.g. "v3 aborted (rank 3, transfer)"), against seconds since the
run started; the queue of groups waiting for the trainer on the same time axis; reward per train step; logprob
agreement per step (log scale: the gaps are ~1e-7, and an exact 0 is drawn on the axis floor); and the lag histogram.
The colours are the Okabe-Ito palette (colour-blind safe); aborts are also hatched. The timeline itself is extracted,
purely, by `rolledger.workflows.timeline.build_timeline`; this module writes the file, drawn by timeline_png.py
(matplotlib) or timeline_html.py (inline SVG) with the palette, labels and axis helpers of timeline_style.py.
"""

from __future__ import annotations

from pathlib import Path

from rolledger.workers.operator.timeline_html import timeline_html
from rolledger.workers.operator.timeline_png import timeline_figure
from rolledger.workflows.timeline import Timeline

SUFFIXES = (".png", ".html", ".htm")


def write_timeline(tl: Timeline, out: Path) -> None:
    """Draw `tl` into `out`: PNG or HTML by its suffix (a ValueError for any other)."""
    if out.suffix == ".png":
        fig = timeline_figure(tl)
        fig.savefig(out, dpi=110)
    elif out.suffix in SUFFIXES:
        out.write_text(timeline_html(tl))
    else:
        raise ValueError(f"timeline output must end in .png or .html, not {out.suffix!r}")
