"""The soak (tests/chaos/soak.py): its pure parts in the main suite, and a short soak under the chaos marker."""

from __future__ import annotations

from pathlib import Path

import pytest

from .soak import flatness, open_at_end, rss_bytes, run_soak, soak_schedule


def test_flatness_compares_the_last_quarter_with_the_first() -> None:
    assert flatness([100, 100, 100, 100, 100, 100, 100, 109]) == (pytest.approx(1.045), True)  # quarters of 2
    ratio, ok = flatness([100, 100, 150, 150, 200, 200, 240, 240])
    assert ratio == pytest.approx(2.4) and not ok
    assert flatness([100, 111]) == (pytest.approx(1.11), False)  # a quarter is at least one sample
    assert flatness([100]) == (1.0, True)  # nothing to compare


def test_a_soak_schedule_fires_a_fault_every_interval_and_keeps_every_process_alive() -> None:
    s = soak_schedule(seed=3, minutes=5, fault_every_s=30)
    assert [step.trigger.at_s for step in s.faults] == [30.0 * k for k in range(1, 11)]
    assert {step.fault.kind for step in s.faults} <= {"net", "stop"}  # no kill, no Redis restart
    assert s.has_net_faults and s.coordinators == 1
    assert soak_schedule(seed=3, minutes=5, fault_every_s=30) == s  # a function of its seed


def test_units_open_at_a_deadline_end_are_told_apart_from_violations() -> None:
    violations = [
        "audit: invariant 7: group g000606 never reached a terminal event before RunFinished",
        "audit: invariant 3: UpdateCommitted v2 without RankPrepared from rank 1",
        "event 01X is in the log 2 times",
    ]
    rest, inflight = open_at_end(violations)
    assert inflight == violations[:1] and rest == violations[1:]


def test_rss_of_this_process_and_of_none() -> None:
    import os

    got = rss_bytes(os.getpid())
    assert got is not None and got > 10 * 2**20
    assert rss_bytes(2**22 + 12345) is None


@pytest.mark.chaos
def test_a_short_soak_samples_memory_and_prints_the_chaos_counts(tmp_path: Path) -> None:
    """Under a minute of soak (a fault every 8 s, memory every 8 s): the figures and the counts are printed, nothing
    acknowledged is lost and the run breaks no invariant (whether memory is flat over so short a soak is printed,
    not asserted: the figure is for `./dev chaos --soak 60`)."""
    lines: list[str] = []
    report = run_soak(0.8, tmp_path, seed=1, fault_every_s=8, sample_every_s=8, out=lines.append)
    text = "\n".join(lines)
    assert report.samples >= 3, text
    assert report.result.verdict.lost == [] and report.violations == [], text
    assert [line for line in lines if line.startswith("t+")], text
    for name in ("driver", "coordinator", "rank0", "rank1", "reward", "trainer", "redis"):
        assert any(line.lstrip().startswith(name) and "last quarter" in line for line in lines), (name, text)
    assert any(line.startswith("faults fired by kind: ") for line in lines), text
    assert lines[-2].startswith("schedules 1, faults injected ") and "runs finished 1" in lines[-2], text
    assert lines[-1].startswith("memory "), text
