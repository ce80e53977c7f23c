"""`rolledger timeline`: the picture is built from the log alone and written as PNG or HTML."""

from __future__ import annotations

from pathlib import Path

import pytest
from logbuilder import LogBuilder

from rolledger.schemas.events import Event
from rolledger.workers.timeline_render import write_timeline
from rolledger.workflows.timeline import build_timeline


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
