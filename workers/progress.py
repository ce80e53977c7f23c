"""The live display of `rolledger run`: step, reward, policy version, lag, queued bytes, admission state (rich)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Self

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from rolledger.schemas.statuses import UpdateStatus
from rolledger.workflows.state import RunState


def status_table(state: RunState) -> Table:
    cfg = state.config
    steps = cfg.steps if cfg else 0
    t = Table(title=f"rolledger run {state.run_id}", show_header=False, expand=False)
    t.add_column("what", style="bold cyan")
    t.add_column("value")
    rewards = state.trainer.rewards
    t.add_row("status", state.status)
    t.add_row("step", f"{state.trainer.step} / {steps}")
    t.add_row("reward (last step)", f"{rewards[-1]:.3f}" if rewards else "-")
    t.add_row("reward (first step)", f"{rewards[0]:.3f}" if rewards else "-")
    t.add_row("policy version", str(state.policy_version))
    t.add_row("lag (now / max consumed)", f"{state.lag} / {state.trainer.max_lag}")
    t.add_row("queued bytes (now / max)", f"{state.admission.queued_bytes} / {state.admission.max_queued_bytes}")
    t.add_row("admission", "open" if state.admission.open else "paused: " + ", ".join(state.admission.paused))
    t.add_row("groups admitted / in flight", f"{state.admission.admitted} / {state.admission.inflight}")
    aborted = sum(1 for u in state.updates.values() if u.status == UpdateStatus.ABORTED)
    t.add_row(
        "updates published / aborted",
        f"{sum(1 for u in state.updates.values() if u.status == UpdateStatus.PUBLISHED)} / {aborted}",
    )
    t.add_row("events", str(state.events_applied))
    return t


class LiveProgress:
    """Redraws at most a few times a second; silent when stdout is not a terminal (CI logs get the summary)."""

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
        """A callback for the supervised warm start: a progress bar in a terminal, a line every 100 steps otherwise."""

        def on_step(step: int, loss: float) -> None:
            if self.live is not None:
                self.live.update(Text(f"warm start {step}/{steps}  loss {loss:.3f}  " + _bar(step / max(steps, 1))))
            elif step % 100 == 0 or step == steps:
                self.console.print(f"warm start {step}/{steps} loss {loss:.3f}")

        return on_step

    def update(self, state: RunState) -> None:
        if self.live is not None:
            self.live.update(status_table(state))
        elif state.trainer.step != self._last_step:  # plain one line per step when not a terminal
            self._last_step = state.trainer.step
            r = state.trainer.rewards
            self.console.print(
                f"step {state.trainer.step} v{state.policy_version} reward {r[-1] if r else float('nan'):.3f} "
                f"lag {state.lag} queued {state.admission.queued_bytes}B admission "
                f"{'open' if state.admission.open else ','.join(state.admission.paused)}"
            )

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)


def _bar(fraction: float, width: int = 30) -> str:
    filled = round(fraction * width)
    return "[" + "#" * filled + "." * (width - filled) + "]"
