"""Every kind of audit warning explains itself: one sentence, printed once above its warnings, saying what it
means and why it is a warning and not a violation (the out_of_order a clean threaded run can show, for one)."""

from __future__ import annotations

import json

from logbuilder import LogBuilder

from rolledger.schemas import events as ev
from rolledger.workflows.audit import WarningKind, audit
from rolledger.workflows.audit_report import WARNING_MEANING


def test_every_warning_kind_has_one_sentence() -> None:
    assert set(WARNING_MEANING) == set(WarningKind)
    for kind, text in WARNING_MEANING.items():
        assert text.endswith(".") and text.count(". ") == 0, kind  # one sentence


def _out_of_order_log() -> list[ev.Event]:
    """A clean run in which two samples of one producer were appended in the reverse of their creation order (as a
    log written before a rank's rollout slots had producer names of their own shows)."""
    b = LogBuilder().start_run()
    b.group()
    b.consume([b.last_group])
    events = b.finish_run().build()
    finished = [i for i, e in enumerate(events) if isinstance(e.payload, ev.SampleFinished)]
    i, j = finished[0], finished[1]
    assert events[i].producer == events[j].producer and j == i + 1
    events[i], events[j] = events[j], events[i]
    return events


def test_a_clean_run_with_out_of_order_ids_passes_and_says_why_that_is_fine() -> None:
    report = audit(_out_of_order_log())
    assert report.passed and [w.kind for w in report.warnings] == [WarningKind.OUT_OF_ORDER]
    lines = report.render().splitlines()
    meaning = [line for line in lines if "warning(s) out_of_order:" in line]
    assert meaning == [f"  1 warning(s) out_of_order: {WARNING_MEANING[WarningKind.OUT_OF_ORDER]}"]
    assert "a producer of its own" in meaning[0] and "nothing is mis-checked" in meaning[0]
    detail = lines.index(meaning[0]) + 1
    assert lines[detail].startswith("  warning out_of_order: SampleFinished ")  # the warning itself follows
    assert json.loads(report.to_json())["warning_kinds"] == {"out_of_order": WARNING_MEANING[WarningKind.OUT_OF_ORDER]}


def test_a_report_without_warnings_explains_nothing() -> None:
    b = LogBuilder().start_run()
    b.group()
    b.consume([b.last_group])
    report = audit(b.finish_run().build())
    assert report.passed and not report.warnings
    assert "warning" not in report.render() and report.to_dict()["warning_kinds"] == {}
