"""The timeline as a self-contained HTML page: the PNG's panels as inline SVG with axes, ticks, hover details and a
time cursor over the lanes and the queue (no CDN, no build step). `_Svg` is the small builder each panel draws on.
"""

from __future__ import annotations

import html
import itertools
import json
import math
from collections.abc import Sequence

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
    nice_ticks,
    summary_line,
)
from rolledger.workflows.timeline import StepPoint, Timeline, UpdateOutcome


def _fmt(x: float) -> str:
    return f"{x:g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.0e}"


class _Svg:
    """A small SVG builder: a plot area inside margins, with linear or log y and axes with ticks."""

    def __init__(self, width: int, height: int, left: int, right: int, top: int, bottom: int, cls: str) -> None:
        self.w, self.h, self.l, self.r, self.t, self.b = width, height, left, right, top, bottom
        self.parts: list[str] = []
        self.cls = cls
        self.x0, self.x1, self.y0, self.y1, self.log = 0.0, 1.0, 0.0, 1.0, False

    def domain(self, x0: float, x1: float, y0: float, y1: float, *, log: bool = False) -> None:
        self.x0, self.x1 = x0, x1 if x1 > x0 else x0 + 1
        self.y0, self.y1, self.log = y0, y1 if y1 > y0 else y0 + 1, log

    def x(self, v: float) -> float:
        return self.l + (v - self.x0) / (self.x1 - self.x0) * (self.w - self.l - self.r)

    def y(self, v: float) -> float:
        if self.log:
            lo, hi, v = math.log10(self.y0), math.log10(self.y1), math.log10(max(v, self.y0))
        else:
            lo, hi = self.y0, self.y1
        return self.h - self.b - (v - lo) / (hi - lo) * (self.h - self.t - self.b)

    def add(self, s: str) -> None:
        self.parts.append(s)

    def axes(
        self, xticks: Sequence[float], yticks: Sequence[float], xlabel: str, ylabel: str, xfmt: str = "{:g}"
    ) -> None:
        left, bottom, right, top = self.l, self.h - self.b, self.w - self.r, self.t
        for v in yticks:
            y = self.y(v)
            label = f"1e{round(math.log10(v))}" if self.log else _fmt(v)
            self.add(
                f'<line class="grid" x1="{left}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}"/>'
                f'<text class="ytick" x="{left - 5}" y="{y + 4:.1f}" text-anchor="end">{label}</text>'
            )
        for v in xticks:
            x = self.x(v)
            self.add(
                f'<line class="tick" x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 4}"/>'
                f'<text class="xtick" x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">'
                f"{xfmt.format(v)}</text>"
            )
        self.add(f'<path class="axis" d="M{left},{top} V{bottom} H{right}"/>')
        self.add(
            f'<text class="xlabel" x="{(left + right) / 2}" y="{self.h - 4}" text-anchor="middle">'
            f"{html.escape(xlabel)}</text>"
        )
        self.add(
            f'<text class="ylabel" transform="translate(12,{(top + bottom) / 2}) rotate(-90)" '
            f'text-anchor="middle">{html.escape(ylabel)}</text>'
        )

    def render(self, title: str, extra: str = "") -> str:
        return (
            f'<figure class="panel {self.cls}"><figcaption>{html.escape(title)}</figcaption>'
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.w}" height="{self.h}" '
            f'viewBox="0 0 {self.w} {self.h}" {extra}>{"".join(self.parts)}</svg></figure>'
        )


def _tip(text: str) -> str:
    return f"<title>{html.escape(text)}</title>"


def _html_lanes(tl: Timeline, width: int) -> str:
    row_h, label_space = 26, 36 if "updates" in tl.rows else 0
    svg = _Svg(width, row_h * len(tl.rows) + label_space + 46, 170, 16, 8, 38, "lanes")
    duration = max(tl.duration, 1e-9)
    svg.domain(0, duration, 0, 1)
    index = {r: i for i, r in enumerate(tl.rows)}
    ticks = nice_ticks(0, duration, 10)
    for v in ticks:
        x = svg.x(v)
        svg.add(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{svg.t}" y2="{svg.h - svg.b}"/>')
    for i in range(1, len(tl.rows)):  # lane groups: ranks | admission | trainer and updates
        a, b = tl.rows[i - 1].split()[0], tl.rows[i].split()[0]
        if a != b and a in ("rank", "admission:"):
            y = svg.t + i * row_h
            svg.add(f'<line class="sep" x1="{svg.l - 160}" x2="{svg.w - svg.r}" y1="{y}" y2="{y}"/>')
    for r, i in index.items():
        y = svg.t + i * row_h
        svg.add(
            f'<text class="lane" x="{svg.l - 8}" y="{y + row_h / 2 + 4}" text-anchor="end">'
            f"{html.escape(lane_name(r))}</text>"
        )
    px = (svg.w - svg.l - svg.r) / duration
    for s in tl.spans:
        update = s.row == "updates"
        x, w = svg.x(s.start), max((s.end - s.start) * px, 5.0 if update else 0.6)
        y = svg.t + index[s.row] * row_h + 3
        fill = "url(#hatch)" if s.kind == "abort" else COLORS[s.kind]
        svg.add(
            f'<rect class="span {s.kind}" x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h - 6}" '
            f'fill="{fill}">{_tip(f"{s.label} ({s.start:.3f} s to {s.end:.3f} s)")}</rect>'
        )
    for s in tl.spans:  # the trainer's steps, named where the bar is wide enough
        text = s.label.split(":")[0]
        if s.kind == "train" and (s.end - s.start) * px > 7 * len(text) + 6:
            ty = svg.t + index[s.row] * row_h + row_h / 2 + 4
            svg.add(
                f'<text class="inbar" x="{svg.x((s.start + s.end) / 2):.1f}" y="{ty}" text-anchor="middle">'
                f"{html.escape(text)}</text>"
            )
    if "updates" in index:
        y = svg.t + index["updates"] * row_h + row_h + 10
        right = [-math.inf, -math.inf]
        for u in sorted(tl.updates, key=lambda u: u.start):
            x = svg.x(u.start)
            for text in [u.label] if u.outcome == "aborted" else [u.label, f"v{u.version}", ""]:
                level = next((lv for lv in (0, 1) if x >= right[lv]), None)
                if level is None and u.outcome == "aborted":
                    level = 0 if right[0] <= right[1] else 1
                if level is not None and text:
                    right[level] = x + 7 * len(text) + 8
                    tx = min(x, svg.w - svg.r - 7 * len(text))  # the last label stays inside the panel
                    svg.add(
                        f'<text class="ulabel {u.outcome}" x="{tx:.1f}" y="{y + 16 * level}">'
                        f"{html.escape(text)}{_tip(_update_detail(u))}</text>"
                    )
                    break
    for u in tl.updates:
        if u.outcome == "aborted":
            x = svg.x(u.end)
            svg.add(
                f'<line class="abortline" x1="{x:.1f}" x2="{x:.1f}" y1="{svg.t}" y2="{svg.h - svg.b}">'
                f"{_tip(_update_detail(u))}</line>"
            )
    svg.axes(ticks, [], TIME_LABEL, "", xfmt="{:g}")
    svg.add(f'<line class="cursor" x1="0" x2="0" y1="{svg.t}" y2="{svg.h - svg.b}" visibility="hidden"/>')
    defs = (
        f'<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><rect width="6" height="6" fill="{COLORS["abort"]}"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="white" stroke-width="2"/></pattern></defs>'
    )
    svg.parts.insert(0, defs)
    return svg.render(PANEL_TITLES[0], f'data-t0="0" data-t1="{duration}" data-left="{svg.l}" data-right="{svg.r}"')


def _update_detail(u: UpdateOutcome) -> str:
    lines = [u.label, f"requested {u.start:.3f} s, closed {u.end:.3f} s"]
    if u.step is not None:
        lines.append(f"weights of train step {u.step}")
    if u.prepared is not None:
        lines.append(f"all ranks prepared at {u.prepared:.3f} s")
    if u.paused is not None:
        lines.append(f"admission paused to commit at {u.paused:.3f} s")
    if u.ranks:
        lines.append(f"published to ranks {', '.join(map(str, u.ranks))}")
    for c in u.culprits:
        tensor = f", tensor {c.tensor}" if c.tensor else ""
        lines.append(f"rank {c.rank} failed at {c.phase or '?'}{tensor}: {c.reason}")
    if u.reason and not u.culprits:
        lines.append(f"reason: {u.reason}")
    return "\n".join(lines)


def _html_queue(tl: Timeline, width: int) -> str:
    svg = _Svg(width, 170, 170, 16, 10, 36, "queue")
    duration = max(tl.duration, 1e-9)
    peak = max((q for _, q in tl.queued), default=0)
    yticks = nice_ticks(0, max(peak, 1), 4)
    svg.domain(0, duration, 0, max(yticks[-1], peak, 1))
    svg.axes(nice_ticks(0, duration, 10), yticks, TIME_LABEL, "groups")
    if tl.queued:
        pts = [(0.0, 0)] + list(tl.queued) + [(tl.duration, tl.queued[-1][1])]
        d = f"M{svg.x(0):.1f},{svg.y(0):.1f}"
        for (_, _q0), (t1, q1) in itertools.pairwise(pts):
            d += f" H{svg.x(t1):.1f} V{svg.y(q1):.1f}"
        svg.add(f'<path class="queueline" d="{d}"/>')
    svg.add(f'<line class="cursor" x1="0" x2="0" y1="{svg.t}" y2="{svg.h - svg.b}" visibility="hidden"/>')
    return svg.render(
        f"{PANEL_TITLES[1]} (completed, not yet trained; peak {peak})",
        f'data-t0="0" data-t1="{duration}" data-left="{svg.l}" data-right="{svg.r}"',
    )


def _legend(svg: _Svg, items: Sequence[tuple[str, str]]) -> None:
    """A one-line key at the top right of the plot area: (css class of the swatch, text)."""
    x = svg.w - svg.r - 4
    for cls, text in reversed(items):
        x -= 7 * len(text) + 4
        svg.add(f'<text class="key" x="{x:.0f}" y="{svg.t + 4}">{html.escape(text)}</text>')
        x -= 18
        svg.add(f'<line class="swatch {cls}" x1="{x:.0f}" x2="{x + 14:.0f}" y1="{svg.t}" y2="{svg.t}"/>')
        x -= 10


def _step_axis(svg: _Svg, steps: Sequence[StepPoint]) -> list[float]:
    lo, hi = (min(s.step for s in steps), max(s.step for s in steps)) if steps else (0, 1)
    svg.x0, svg.x1 = lo - 0.5, hi + 0.5
    return [float(v) for v in nice_ticks(lo, hi, 8) if float(v).is_integer()] or [float(lo)]


def _html_reward(tl: Timeline, width: int) -> str:
    svg = _Svg(width, 250, 56, 14, 22, 40, "reward")
    trained = [s for s in tl.steps if not s.refused]
    rewards = [s.reward_mean for s in trained if math.isfinite(s.reward_mean)]
    lo, hi = (min(rewards + [0.0]), max(rewards + [1.0])) if rewards else (0.0, 1.0)
    yticks = nice_ticks(lo, hi, 5)
    svg.domain(0, 1, min(yticks[0], lo), max(yticks[-1], hi))
    xticks = _step_axis(svg, tl.steps)
    svg.axes(xticks, yticks, "train step", "mean reward")
    for u in aborted_steps(tl):
        assert u.step is not None
        x = svg.x(u.step)
        svg.add(
            f'<line class="abortline" x1="{x:.1f}" x2="{x:.1f}" y1="{svg.t}" y2="{svg.h - svg.b}">'
            f"{_tip(f'step {u.step}: {_update_detail(u)}')}</line>"
        )
    if trained:
        pts = " ".join(f"{svg.x(s.step):.1f},{svg.y(s.reward_mean):.1f}" for s in trained)
        svg.add(f'<polyline class="rewardline" points="{pts}"/>')
        for s in trained:
            svg.add(
                f'<circle class="reward" cx="{svg.x(s.step):.1f}" cy="{svg.y(s.reward_mean):.1f}" r="4">'
                f"{_tip(f'step {s.step} at {s.t:.3f} s: mean reward {s.reward_mean:.4f}, loss {s.loss:.4g}')}"
                "</circle>"
            )
    keys = [("rewardline", "mean reward")] + ([("abortline", "its update aborted")] if aborted_steps(tl) else [])
    _legend(svg, keys)
    return svg.render(PANEL_TITLES[2])


def _html_agreement(tl: Timeline, width: int) -> str:
    svg = _Svg(width, 250, 56, 14, 22, 40, "agreement")
    floor = gap_floor(tl.steps)
    gaps = [g for s in tl.steps if s.measured or s.refused for g in (s.gap_median, s.gap_p99) if math.isfinite(g)]
    top = 10 ** (math.ceil(math.log10(max(gaps + [floor * 10]))) + 1)  # a decade of headroom for the key
    svg.domain(0, 1, floor / 3, top, log=True)  # an exact 0 sits on the floor, above the axis
    decades = range(round(math.log10(floor)), round(math.log10(top)) + 1)
    yticks = [10.0**k for k in decades][:: max(1, len(decades) // 6)]
    xticks = _step_axis(svg, tl.steps)
    svg.axes(xticks, yticks, "train step (steps with no on-policy tokens are left out)", "|Δ logprob| (nats)")
    svg.add(
        f'<line class="grid" x1="{svg.l}" x2="{svg.w - svg.r}" y1="{svg.y(floor):.1f}" y2="{svg.y(floor):.1f}" '
        f'stroke-dasharray="2 2"/><text class="note" x="{svg.w - svg.r - 4}" y="{svg.y(floor) + 12:.1f}" '
        'text-anchor="end">exactly 0</text>'
    )
    measured = [s for s in tl.steps if s.measured and not s.refused]
    for attr, cls in (("gap_median", "median"), ("gap_p99", "p99")):
        if measured:
            pts = " ".join(f"{svg.x(s.step):.1f},{svg.y(max(getattr(s, attr), floor)):.1f}" for s in measured)
            svg.add(f'<polyline class="gapline {cls}" points="{pts}"/>')
        for s in measured:
            g = getattr(s, attr)
            svg.add(
                f'<circle class="gap {cls}" cx="{svg.x(s.step):.1f}" cy="{svg.y(max(g, floor)):.1f}" r="3.5">'
                f"{_tip(_gap_detail(s))}</circle>"
            )
    for s in tl.steps:
        if s.refused:
            x, y = svg.x(s.step), svg.y(max(s.gap_median, floor))
            svg.add(
                f'<path class="refused" d="M{x - 5:.1f},{y - 5:.1f} L{x + 5:.1f},{y + 5:.1f} M{x - 5:.1f},'
                f'{y + 5:.1f} L{x + 5:.1f},{y - 5:.1f}">{_tip(_gap_detail(s))}</path>'
            )
    keys = [("gapline median", "median gap"), ("gapline p99", "p99 gap")]
    _legend(svg, keys + ([("refused", "step refused")] if any(s.refused for s in tl.steps) else []))
    return svg.render(PANEL_TITLES[3] + " |trainer − engine| (log scale)")


def _gap_detail(s: StepPoint) -> str:
    def g(v: float) -> str:
        return "0 (exact)" if v == 0 else f"{v:.3g}"

    head = f"step {s.step}" + (f" refused: {s.refused}" if s.refused else "")
    return f"{head}\nmedian gap {g(s.gap_median)}, p99 {g(s.gap_p99)} over {s.agreement_tokens} on-policy tokens"


def _html_lag(tl: Timeline, width: int) -> str:
    svg = _Svg(width, 250, 50, 14, 22, 40, "lag")
    lags = sorted(tl.lag_histogram) or [0]
    most = max(tl.lag_histogram.values(), default=1)
    yticks = nice_ticks(0, most, 4)
    svg.domain(lags[0] - 0.5, lags[-1] + 0.5, 0, max(yticks[-1], most * 1.12))
    svg.axes([float(k) for k in range(lags[0], lags[-1] + 1)], yticks, "versions behind the trainer", "groups")
    total = sum(tl.lag_histogram.values()) or 1
    bw = min((svg.x(1) - svg.x(0)) * 0.7, 60.0)
    for k, n in sorted(tl.lag_histogram.items()):
        x, y = svg.x(k) - bw / 2, svg.y(n)
        svg.add(
            f'<rect class="lagbar" x="{x:.1f}" y="{y:.1f}" width="{bw:.1f}" height="{svg.y(0) - y:.1f}">'
            f"{_tip(f'lag {k}: {n} groups ({100 * n / total:.0f}% of those consumed)')}</rect>"
            f'<text class="barlabel" x="{svg.x(k):.1f}" y="{y - 4:.1f}" text-anchor="middle">{n}</text>'
        )
    return svg.render(PANEL_TITLES[4])


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:18px;color:#222}
h1{font-size:20px;margin:0 0 4px} .summary{color:#555;margin:0 0 10px}
.legend span{display:inline-flex;align-items:center;margin:0 14px 6px 0;font-size:13px}
.legend i{display:inline-block;width:22px;height:12px;margin-right:5px;border-radius:2px}
figure{margin:8px 0 14px} figcaption{font-weight:600;font-size:14px;margin-bottom:2px}
.row{display:flex;gap:12px;flex-wrap:wrap}
svg{font-size:11px;overflow:visible} .grid{stroke:#eee} .tick,.axis{stroke:#555;fill:none}
.xtick,.ytick,.note{fill:#444} .xlabel,.ylabel{fill:#222;font-size:12px} .lane{font-size:12px;fill:#222} .inbar{pointer-events:none;fill:#222}
.span:hover,.lagbar:hover{stroke:#000;stroke-width:1.5} .ulabel{font-size:11px;fill:#222}
.ulabel.aborted{fill:#D55E00;font-weight:700} .abortline{stroke:#D55E00;stroke-dasharray:4 3;stroke-width:1.5}
.cursor{stroke:#000;stroke-width:1;stroke-dasharray:2 2;pointer-events:none}
.queueline{fill:none;stroke:$QUEUE;stroke-width:1.8} .rewardline{fill:none;stroke:$REWARD;stroke-width:1.8}
.reward{fill:$REWARD} .gapline{fill:none;stroke-width:1.2;opacity:.7} .gapline.median{stroke:$MEDIAN}
.gapline.p99{stroke:$P99} .gap.median{fill:$MEDIAN} .gap.p99{fill:$P99}
.refused{stroke:#000;stroke-width:2.5} .sep{stroke:#999} .key{fill:#333}
.swatch{stroke-width:3} .swatch.rewardline,.swatch.median,.swatch.p99{stroke-width:3;opacity:1} .lagbar{fill:$LAG} .barlabel{fill:#222}
circle:hover{r:6} #tip{position:fixed;pointer-events:none;background:#fff;border:1px solid #999;padding:3px 6px;
font-size:12px;border-radius:3px;display:none;white-space:pre}
"""
_PALETTE = {"QUEUE": QUEUE_COLOR, "REWARD": REWARD_COLOR, "MEDIAN": MEDIAN_COLOR, "P99": P99_COLOR, "LAG": LAG_COLOR}
for _name, _color in _PALETTE.items():
    _CSS = _CSS.replace(f"${_name}", _color)

# The time cursor: moving over the lanes or the queue shows the time (and the queue then) in a small tip.
_JS = """
(function(){
const tip=document.getElementById('tip'), queue=JSON.parse(document.getElementById('queue-data').textContent);
const svgs=[...document.querySelectorAll('figure.lanes svg, figure.queue svg')];
function at(t){let q=0;for(const [ts,n] of queue){if(ts>t)break;q=n;}return q;}
svgs.forEach(svg=>{
  svg.addEventListener('mousemove',ev=>{
    const box=svg.getBoundingClientRect(), w=+svg.getAttribute('width'), sx=w/box.width;
    const x=(ev.clientX-box.left)*sx, l=+svg.dataset.left, r=w-(+svg.dataset.right);
    if(x<l||x>r){svgs.forEach(s=>s.querySelector('.cursor').setAttribute('visibility','hidden'));tip.style.display='none';return;}
    const t=(+svg.dataset.t0)+(x-l)/(r-l)*((+svg.dataset.t1)-(+svg.dataset.t0));
    svgs.forEach(s=>{const c=s.querySelector('.cursor');c.setAttribute('x1',x);c.setAttribute('x2',x);c.setAttribute('visibility','visible');});
    const over=ev.target.querySelector&&ev.target.querySelector('title');
    tip.textContent=t.toFixed(3)+' s · '+at(t)+' groups waiting'+(over?'\\n'+over.textContent:'');
    tip.style.left=(ev.clientX+14)+'px';tip.style.top=(ev.clientY+14)+'px';tip.style.display='block';
  });
  svg.addEventListener('mouseleave',()=>{tip.style.display='none';svgs.forEach(s=>s.querySelector('.cursor').setAttribute('visibility','hidden'));});
});
})();
"""


def timeline_html(tl: Timeline) -> str:
    """The self-contained HTML page: the same panels as the PNG, as inline SVG with hover details."""
    kinds = {s.kind for s in tl.spans}
    legend = "".join(
        f'<span><i style="background:{COLORS[k]}{";background-image:repeating-linear-gradient(45deg,transparent 0 3px,#fff 3px 5px)" if k == "abort" else ""}"></i>{html.escape(label)}</span>'
        for k, label in LEGEND.items()
        if k in kinds or k in ("generate", "paused", "train", "commit")
    )
    queue_data = json.dumps([[round(t, 6), q] for t, q in tl.queued]).replace("</", "<\\/")
    body = (
        f"<h1>rolledger timeline · run {html.escape(tl.run_id)}</h1>"
        f'<p class="summary">{html.escape(summary_line(tl))}</p><div class="legend">{legend}</div>'
        f"{_html_lanes(tl, 1200)}{_html_queue(tl, 1200)}"
        f'<div class="row">{_html_reward(tl, 440)}{_html_agreement(tl, 440)}{_html_lag(tl, 290)}</div>'
        f'<div id="tip"></div><script type="application/json" id="queue-data">{queue_data}</script>'
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>rolledger timeline {html.escape(tl.run_id)}</title>"
        f"<style>{_CSS}</style></head><body>{body}<script>{_JS}</script></body></html>\n"
    )
