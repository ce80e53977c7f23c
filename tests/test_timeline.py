"""`rolledger timeline`: the picture is built from the log alone and written as PNG or HTML."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from xml.etree import ElementTree

import numpy as np
import pytest
from logbuilder import LogBuilder

from rolledger.events.codec import decode
from rolledger.schemas import events as ev
from rolledger.schemas.events import Event
from rolledger.workers.operator.timeline_html import timeline_html
from rolledger.workers.operator.timeline_png import timeline_figure
from rolledger.workers.operator.timeline_render import write_timeline
from rolledger.workers.operator.timeline_style import PANEL_TITLES
from rolledger.workflows.timeline import Culprit, Timeline, build_timeline

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import history  # tests/fixtures is not a package: it holds data and the scripts that make it


def run_log() -> list[Event]:
    b = LogBuilder(group_size=2).start_run()
    b.group()
    first = b.last_group
    b.update(1)
    b.group()
    b.consume([first, b.last_group], lags=(1, 0))
    b.update(2, fail_rank=0)
    return b.finish_run().build()


def test_the_timeline_shows_groups_updates_aborts_and_the_lag_histogram() -> None:
    tl = build_timeline(run_log())
    kinds = {s.kind for s in tl.spans}
    assert {"generate", "prepare", "commit", "abort", "train", "paused"} <= kinds
    assert tl.rows[0] == "rank 0" and "updates" in tl.rows and "trainer" in tl.rows
    assert any(s.kind == "abort" and "v2 aborted" in s.label for s in tl.spans)
    assert tl.lag_histogram == {0: 1, 1: 1}
    assert [q for _, q in tl.queued] == [1, 2, 0]  # two groups completed, then both consumed
    assert all(0 <= s.start <= s.end <= tl.duration for s in tl.spans)


@pytest.mark.parametrize("suffix", [".png", ".html"])
def test_it_writes_png_and_html(tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"t{suffix}"
    write_timeline(build_timeline(run_log()), out)
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") if suffix == ".png" else b"<svg" in data and b"v2 aborted" in data


def test_other_formats_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\.png or \.html"):
        write_timeline(build_timeline(run_log()), tmp_path / "t.pdf")


# ---------------------------------------------------------------------------------------------------- the data panels
def fixture_timeline(name: str) -> Timeline:
    _, entries = history.load_entries(name)
    return build_timeline(decode(payload) for _, payload in entries)


def test_each_update_carries_its_outcome_and_the_culprit_of_an_abort() -> None:
    tl = build_timeline(run_log())
    assert [(u.version, u.outcome) for u in tl.updates] == [(1, "published"), (2, "aborted")]
    aborted = tl.updates[1]
    assert aborted.culprits == (Culprit(rank=0, phase="transfer", reason="checksum", tensor="lm_head.weight"),)
    assert aborted.label == "v2 aborted (rank 0, transfer)"
    assert aborted.step == 1  # the weights of the step trained just before it was staged
    assert aborted.start < aborted.end and aborted.prepared is None  # no rank prepared it all the way
    assert tl.updates[0].ranks == (0,) and tl.updates[0].label == "v1 published"
    assert any(s.kind == "abort" and s.label.startswith("v2 aborted (rank 0, transfer): ") for s in tl.spans)


def test_a_real_abort_names_the_rank_and_phase_that_failed() -> None:
    tl = fixture_timeline("abort")  # a run with fail-rank=1@transfer
    (aborted,) = [u for u in tl.updates if u.outcome == "aborted"]
    assert aborted.label == "v1 aborted (rank 1, transfer)"
    assert aborted.culprits[0].rank == 1 and "injected fail-rank=1@transfer" in aborted.culprits[0].reason
    assert [u.label for u in tl.updates if u.outcome == "published"] == ["v2 published", "v3 published"]


def test_aborts_without_a_failure_event_take_the_phase_from_the_reason_or_show_the_reason() -> None:
    b = LogBuilder(group_size=2, ranks=2).start_run()
    b.stage(1).request_prepare(1).prepare(1, 0).abort(1, "prepare deadline passed for ranks [1]", failed_ranks=(1,))
    b.stage(2).request_prepare(2).stage(3).abort(2, "superseded by v3")
    b.request_prepare(3).prepare(3, 0)  # still open when the log ends
    tl = build_timeline(b.build())
    labels = {u.version: u.label for u in tl.updates}
    assert labels == {1: "v1 aborted (rank 1, prepare deadline)", 2: "v2 aborted (superseded by v3)", 3: "v3 open"}
    assert tl.updates[0].prepared is not None  # rank 0 had prepared v1
    assert tl.updates[-1].end == tl.duration


def test_every_train_step_carries_its_reward_and_agreement() -> None:
    tl = fixture_timeline("abort")
    _, entries = history.load_entries("abort")
    logged = [e.payload for e in map(decode, (p for _, p in entries)) if isinstance(e.payload, ev.TrainStepFinished)]
    assert [(s.step, s.reward_mean, s.gap_median, s.gap_p99, s.agreement_tokens) for s in tl.steps] == [
        (p.step, p.reward_mean, p.logprob_gap_median, p.logprob_gap_p99, p.agreement_tokens) for p in logged
    ]
    assert [s.measured for s in tl.steps] == [True, False, True]  # step 2 had no on-policy token to compare
    assert 0 < max(s.gap_p99 for s in tl.steps) < 1e-5


def test_a_refused_step_is_a_point_without_reward() -> None:
    b = LogBuilder(group_size=2).start_run()
    b.group()
    b.consume([b.last_group])
    b.emit(
        ev.TrainStepRefused(
            step=2, version=0, reason="weights never arrived", gap_median=0.4, gap_p99=1.2, agreement_tokens=8
        )
    )
    tl = build_timeline(b.build())
    trained, refused = tl.steps
    assert trained.reward_mean == 1.0 and not trained.refused
    assert refused.refused == "weights never arrived" and math.isnan(refused.reward_mean) and refused.gap_p99 == 1.2


# ---------------------------------------------------------------------------------------------------- the pictures
def test_the_png_has_every_panel_laid_out_without_overlap(tmp_path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text
    from PIL import Image

    tl = fixture_timeline("abort")
    fig = timeline_figure(tl)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert all(any(t.startswith(p) for t in titles) for p in PANEL_TITLES), titles
    lanes = next(ax for ax in fig.axes if ax.get_title(loc="left") == PANEL_TITLES[0])
    assert lanes.get_xlabel() == "seconds since run start"
    assert {"rank 0", "rank 1", "admission paused: lag", "trainer", "weight updates"} <= {
        t.get_text() for t in lanes.get_yticklabels()
    }
    assert "v1 aborted (rank 1, transfer)" in {t.get_text() for t in lanes.texts}
    agreement = next(ax for ax in fig.axes if ax.get_title(loc="left").startswith(PANEL_TITLES[3]))
    assert agreement.get_yscale() == "log"
    reward = next(ax for ax in fig.axes if ax.get_title(loc="left") == PANEL_TITLES[2])
    xy = np.asarray(reward.lines[0].get_xydata(), dtype=float)
    assert xy.tolist() == [[s.step, s.reward_mean] for s in tl.steps]

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    header = next(ax for ax in fig.axes if not ax.axison)
    key = header.get_legend()
    assert key is not None
    legend = key.get_window_extent(renderer)
    (title,) = (t for t in fig.findobj(Text) if t.get_text() == "rolledger timeline · run fx-abort")
    assert not title.get_window_extent(renderer).overlaps(legend)  # the title clears the legend
    panels = [ax.get_window_extent(renderer) for ax in fig.axes if ax.axison]
    assert not any(a.overlaps(b) for i, a in enumerate(panels) for b in panels[i + 1 :])
    assert not any(legend.overlaps(p) for p in panels)

    out = tmp_path / "t.png"
    write_timeline(tl, out)
    with Image.open(out) as img:
        img.verify()
    with Image.open(out) as img:
        w, h = fig.get_size_inches() * 110
        assert img.format == "PNG" and img.size == (int(w), int(h))


def test_the_html_has_the_panels_with_ticks_and_hover_details_of_an_abort() -> None:
    page = timeline_html(fixture_timeline("abort"))
    for title in PANEL_TITLES:
        assert f"<figcaption>{title}" in page
    svgs = re.findall(r"<svg .*?</svg>", page, flags=re.DOTALL)
    assert len(svgs) == 5
    for svg in svgs:
        ElementTree.fromstring(svg)  # each panel is well-formed SVG
    ns = {"s": "http://www.w3.org/2000/svg"}
    lanes = ElementTree.fromstring(svgs[0])
    ticks = [t.text for t in lanes.iterfind(".//s:text[@class='xtick']", ns)]
    assert ticks[:3] == ["0", "0.05", "0.1"]
    assert "seconds since run start" in [t.text for t in lanes.iterfind(".//s:text[@class='xlabel']", ns)]
    abort = lanes.find(".//s:rect[@class='span abort']/s:title", ns)
    assert abort is not None and abort.text is not None and abort.text.startswith("v1 aborted (rank 1, transfer)")
    label = lanes.find(".//s:text[@class='ulabel aborted']", ns)
    assert label is not None and label.text == "v1 aborted (rank 1, transfer)"
    hover = "".join(label.itertext())
    assert "rank 1 failed at transfer: version 1: transfer interrupted" in hover
    agreement = ElementTree.fromstring(svgs[3])
    assert [t.text for t in agreement.iterfind(".//s:text[@class='ytick']", ns)][:2] == ["1e-8", "1e-7"]
    gap_tips = [t.text or "" for t in agreement.iterfind(".//s:circle/s:title", ns)]
    assert any("p99 4.77e-07 over 23 on-policy tokens" in t for t in gap_tips)
    reward_tips = [t.text or "" for t in ElementTree.fromstring(svgs[2]).iterfind(".//s:circle/s:title", ns)]
    assert len(reward_tips) == 3 and reward_tips[0].startswith("step 1 at ")
    assert "cdn" not in page.lower() and "<script src" not in page
