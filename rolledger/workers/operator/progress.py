"""The live display of `rolledger run` and the state table of `rolledger status`/`replay` (rich).

One set of words for both: step/steps, policy version, the reward pair (`workflows.figures.reward_edges`, the
summary's definition), logprob agreement, the queue (groups and bytes), lag against its cap, and admission with why
it is not admitting (`workflows.figures.admission_words`: the trainer setting the pace is not an alarm)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Self

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from rolledger.workflows.figures import REWARD_EDGES_LABEL, admission_words, format_bytes, format_reward_edges
from rolledger.workflows.state import RunState

WARM_START_S_PER_STEP = 0.05  # the default warm start (400 steps) takes about 20 s on a 2-core CPU


def _max_lag(state: RunState) -> int | None:
    return state.config.admission.max_lag if state.config else None


def _agreement(state: RunState) -> str:
    """The last step's median |trainer - engine| logprob gap on on-policy tokens, or `-` before there is one."""
    gaps = state.trainer.logprob_gaps
    if not gaps:
        return "-"
    return "0" if gaps[-1] == 0 else f"{gaps[-1]:.1e}"


def _queue(state: RunState) -> str:
    return f"{len(state.ready_groups())} groups, {format_bytes(state.admission.queued_bytes)}"


def _lag(state: RunState) -> str:
    cap = _max_lag(state)
    return f"{state.lag}/{cap if cap is not None else '?'}"


def progress_line(state: RunState) -> str:
    """One line per trainer step when stdout is not a terminal, e.g.
    `step 3/40 v2  reward 0.537 -> 0.590 (mean of the first/last 5 steps)  agreement 0.0e+00  queue 2 groups, 5.2 kB
    lag 0/1  admission: waiting for the trainer (lag cap, rate throttle)`."""
    cfg = state.config
    admission, _alarm = admission_words(state)
    return (
        f"step {state.trainer.step}/{cfg.steps if cfg else '?'} v{state.policy_version}  "
        f"reward {format_reward_edges(state.trainer.rewards)} ({REWARD_EDGES_LABEL})  "
        f"agreement {_agreement(state)}  queue {_queue(state)}  lag {_lag(state)}  admission: {admission}"
    )


def status_table(state: RunState) -> Table:
    """The run's state as a table: the live display of `rolledger run` in a terminal, `rolledger status`/`replay`."""
    cfg = state.config
    steps = cfg.steps if cfg else 0
    t = Table(title=f"rolledger run {state.run_id}", show_header=False, expand=False)
    t.add_column("what", style="bold cyan")
    t.add_column("value")
    admission, alarm = admission_words(state)
    t.add_row("status", state.status)
    t.add_row("step", f"{state.trainer.step} / {steps}")
    t.add_row(f"reward ({REWARD_EDGES_LABEL})", format_reward_edges(state.trainer.rewards))
    t.add_row("logprob agreement (last step)", _agreement(state))
    t.add_row("policy version", str(state.policy_version))
    t.add_row("lag (now / cap)", _lag(state) + f"   max consumed {state.trainer.max_lag}")
    t.add_row("queue (groups, bytes)", f"{_queue(state)}   max {format_bytes(state.admission.max_queued_bytes)}")
    t.add_row("admission", Text(admission, style="bold red" if alarm else ""))
    t.add_row("groups admitted / in flight", f"{state.admission.admitted} / {state.admission.inflight}")
    t.add_row("updates published / aborted", f"{state.updates_published} / {state.updates_aborted}")
    t.add_row("events", str(state.events_applied))
    return t


def warm_start_intro(steps: int) -> str:
    """The line printed before the warm start: what it is for and how long it takes."""
    return (
        f"warm start: {steps} supervised steps so the tiny policy can answer at all before RL starts "
        f"(~{max(round(steps * WARM_START_S_PER_STEP), 1)} s on a 2-core CPU)"
    )


class LiveProgress:
    """Redraws at most a few times a second in a terminal; one line per trainer step otherwise (CI logs, pipes)."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self.live: Live | None = None
        self._last_step = -1

    def __enter__(self) -> Self:
        if self.console.is_terminal:
            self.live = Live(console=self.console, refresh_per_second=4)
            self.live.__enter__()
        return self

    def warm_start(self, steps: int) -> Callable[[int, float], None]:
        """A callback for the supervised warm start, `on_step(step, loss)`: step 0 (before the first step) prints what
        the warm start is for and roughly how long it takes; then a bar, redrawn in a terminal, or a line every ~10%
        of the steps otherwise. Called first at a later step, it prints the intro then."""
        every = max(steps // 10, 1)
        started: list[float] = []

        def on_step(step: int, loss: float) -> None:
            if not started:
                started.append(time.monotonic())
                self.console.print(warm_start_intro(steps), markup=False, highlight=False, soft_wrap=True)
                if step == 0:
                    return
            elapsed = time.monotonic() - started[0]
            left = elapsed / max(step, 1) * (steps - step)
            text = f"warm start {_bar(step / max(steps, 1))} {step}/{steps}  loss {loss:.3f}  {elapsed:.0f} s" + (
                f", ~{left:.0f} s left" if step < steps else ""
            )
            if self.live is not None:
                self.live.update(Text(text))
            elif step % every == 0 or step == steps:
                self.console.print(text, markup=False, highlight=False, soft_wrap=True)

        return on_step

    def update(self, state: RunState) -> None:
        if self.live is not None:
            self.live.update(status_table(state))
        elif state.trainer.step != self._last_step:  # plain one line per step when not a terminal
            self._last_step = state.trainer.step
            self.console.print(progress_line(state), markup=False, highlight=False, soft_wrap=True)

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)


def _bar(fraction: float, width: int = 30) -> str:
    filled = round(min(max(fraction, 0.0), 1.0) * width)
    return "[" + "#" * filled + "." * (width - filled) + "]"
