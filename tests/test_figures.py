"""One set of numbers: the reward pair's single definition (workflows/figures.py), and the progress line and state
table that `rolledger run`, `status` and `replay` print from it (captured from a rich Console)."""

from __future__ import annotations

import io
import math

from logbuilder import LogBuilder
from rich.console import Console

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import AdmissionReason
from rolledger.workers.operator.progress import LiveProgress, progress_line, status_table, warm_start_intro
from rolledger.workflows.figures import (
    EDGE_STEPS,
    REWARD_EDGES_LABEL,
    admission_words,
    format_bytes,
    format_reward_edges,
    reward_edges,
)
from rolledger.workflows.reducer import fold
from rolledger.workflows.state import RunState
from rolledger.workflows.summary import summarize


def test_reward_edges_average_the_first_and_last_five_steps() -> None:
    rewards = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    first, last = reward_edges(rewards) or (math.nan, math.nan)
    assert EDGE_STEPS == 5 and REWARD_EDGES_LABEL == "mean of the first/last 5 steps"
    assert math.isclose(first, 0.2) and math.isclose(last, 0.8)
    assert reward_edges([0.25, 0.75]) == (0.5, 0.5)  # fewer steps than the window: both are the mean of all
    assert reward_edges([]) is None
    assert format_reward_edges([]) == "-" and format_reward_edges(rewards) == "0.200 -> 0.800"


def _state(rewards: list[float], *, gap: float = 1e-7, paused: tuple[AdmissionReason, ...] = ()) -> RunState:
    """A folded run whose trainer took one step per reward, with one completed group left in the queue."""
    b = LogBuilder(steps=40).start_run()
    for step, reward in enumerate(rewards, start=1):
        b.group().consume([b.last_group], train=False)
        b.emit(
            ev.TrainStepFinished(
                step=step,
                loss=0.5,
                reward_mean=reward,
                logprob_gap_median=gap,
                logprob_gap_p99=gap,
                agreement_tokens=10,
                max_seq_ratio=1.0,
                clipped_frac=0.0,
            ),
            producer="trainer",
        )
    b.group()  # completed, not yet consumed: the queue holds it
    for reason in paused:
        b.pause(reason)
    state = RunState()
    for e in b.build():
        state = fold(state, e)
    return state


def test_summary_and_status_table_show_the_same_reward_pair() -> None:
    rewards = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    state = _state(rewards)
    summary = summarize(state, [])
    first, last = reward_edges(rewards) or (math.nan, math.nan)
    assert (summary.reward_first, summary.reward_last) == (first, last)
    out = io.StringIO()
    Console(file=out, width=200).print(status_table(state))
    text = out.getvalue()
    assert f"reward ({REWARD_EDGES_LABEL})" in text and f"{first:.3f} -> {last:.3f}" in text
    assert "0.700" not in text  # not the last single step
    assert f"{first:.3f} -> {last:.3f} ({REWARD_EDGES_LABEL})" in progress_line(state)


def test_progress_line_at_step_zero_shows_a_dash_not_nan() -> None:
    line = progress_line(_state([]))
    assert "nan" not in line
    assert line.startswith("step 0/40 v0  reward - (mean of the first/last 5 steps)  agreement -")
    assert "lag 0/1" in line  # now / the cap (admission.max_lag)


def test_progress_line_names_what_a_person_needs() -> None:
    state = _state([0.25, 0.5], gap=1.04e-7, paused=(AdmissionReason.LAG, AdmissionReason.RATE))
    line = progress_line(state)
    assert line.startswith("step 2/40 v0  reward 0.375 -> 0.375")
    assert "agreement 1.0e-07" in line
    assert "agreement 0  " in progress_line(_state([0.5], gap=0.0))
    assert state.admission.queued_bytes > 0
    assert f"queue 1 groups, {format_bytes(state.admission.queued_bytes)}  lag" in line
    assert "lag 0/1" in line
    # the trainer setting the pace reads as waiting, with why, not as an alarm
    assert line.endswith("admission: waiting for the trainer (lag cap, rate throttle)")
    assert "PAUSED" not in line


def test_bytes_read_at_a_glance() -> None:
    assert [format_bytes(n) for n in (0, 588, 5168, 47_000_000)] == ["0 B", "588 B", "5.2 kB", "47.0 MB"]


def test_admission_words_alarm_only_on_a_halt() -> None:
    def words(*paused: AdmissionReason) -> tuple[str, bool]:
        return admission_words(_state([0.5], paused=paused))

    assert words() == ("open", False)
    assert words(AdmissionReason.RATE) == ("waiting for the trainer (rate throttle)", False)
    assert words(AdmissionReason.UPDATE) == ("weight update in progress", False)
    assert words(AdmissionReason.BYTES, AdmissionReason.HANDOFF) == (
        "waiting for the trainer (byte cap); engines handed to the trainer (colocated)",
        False,
    )
    # a manual pause while the run still has steps to go is a halt: the one alarm
    assert words(AdmissionReason.RATE, AdmissionReason.MANUAL) == (
        "PAUSED: run halted; waiting for the trainer (rate throttle)",
        True,
    )


def test_the_manual_pause_that_ends_a_run_is_not_an_alarm() -> None:
    for status, expected in (
        ("completed", "closed: the run reached its last step"),
        ("cancelled", "closed: the run was stopped"),
    ):
        b = LogBuilder().start_run()
        b.pause(AdmissionReason.MANUAL).finish_run(status)
        state = RunState()
        for e in b.build():
            state = fold(state, e)
        assert admission_words(state) == (expected, False)
        assert progress_line(state).endswith(f"admission: {expected}")


def test_the_live_display_prints_one_line_per_step_when_not_a_terminal() -> None:
    out = io.StringIO()
    progress = LiveProgress(Console(file=out, width=80))  # a StringIO is not a terminal
    with progress:
        progress.update(_state([]))
        progress.update(_state([]))  # same step: nothing more
        progress.update(_state([0.5]))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines  # not wrapped at 80 columns: one line each
    assert lines[0].startswith("step 0/40") and lines[1].startswith("step 1/40")


def test_warm_start_says_why_then_prints_a_bar_every_tenth_when_not_a_terminal() -> None:
    out = io.StringIO()
    progress = LiveProgress(Console(file=out, width=200))
    on_step = progress.warm_start(400)
    on_step(0, math.nan)  # before the first step (workers/local_run.prepare_policy)
    for step in range(1, 401):
        on_step(step, 1.0 / step)
    lines = out.getvalue().splitlines()
    assert lines[0] == warm_start_intro(400)
    assert (
        lines[0].startswith("warm start: 400 supervised steps so the tiny policy can answer at all")
        and "~20 s" in lines[0]
    )
    bars = lines[1:]
    assert len(bars) == 10  # every 40 steps
    assert bars[0].startswith("warm start [###...") and " 40/400 " in bars[0] and " s left" in bars[0]
    assert bars[-1].startswith("warm start [" + "#" * 30 + "] 400/400  loss 0.003")
