"""Fault injection at run time: the run's pending injections, and the wrappers that make them fire.

The vocabulary (`--inject` specs) is `rolledger.schemas.injection`. Workers never test for faults themselves: a
faulty engine, a faulty staging store or a faulty trainer step wraps the real one and fires the matching injection
once, at its first opportunity.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

from rolledger.schemas.injection import Injection
from rolledger.workers.runtime import WorkerKilled

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class Injector:
    """The run's injections; `take` returns a matching one once and never again (thread-safe enough: one owner per kind)."""

    def __init__(self, injections: list[Injection] | tuple[Injection, ...] = ()) -> None:
        self._pending = list(injections)
        self.fired: list[Injection] = []

    def peek(self, kind: str, **match: object) -> Injection | None:
        for inj in self._pending:
            if inj.kind == kind and all(getattr(inj, k) == v for k, v in match.items()):
                return inj
        return None

    def take(self, kind: str, **match: object) -> Injection | None:
        inj = self.peek(kind, **match)
        if inj is not None:
            self._pending.remove(inj)
            self.fired.append(inj)
        return inj


# ---------------------------------------------------------------- engine and staging faults (rank side)


# ---------------------------------------------------------------- trainer and worker faults
# A worker exposes the part a fault wraps as a typed attribute (the trainer's `train`, the coordinator's
# `append_decisions`, the reward worker's `scorer`); the driver replaces it with the wrapper. A wrapper fires its
# injection once and is inert after, so a restarted worker may be wrapped again without the fault firing twice.


def slow_and_mortal_trainer(train: Callable[P, R], injector: Injector) -> Callable[P, R]:
    """The trainer's step, with delay-trainer=S (sleeps S seconds before its first step) and kill-worker=trainer@N
    (dies before its N-th step, with nothing of that step appended)."""
    calls = 0

    def step(*args: P.args, **kwargs: P.kwargs) -> R:
        nonlocal calls
        calls += 1
        delay = injector.take("delay-trainer")
        if delay is not None:
            time.sleep(delay.seconds)  # the injected fault itself: a slow trainer
        kill = injector.peek("kill-worker", worker="trainer")
        if kill is not None and calls >= kill.after:
            injector.take("kill-worker", worker="trainer")
            raise WorkerKilled(f"trainer killed before its step (call {calls})")
        return train(*args, **kwargs)

    return step


def mortal_coordinator(append: Callable[P, bool], injector: Injector) -> Callable[P, bool]:
    """The coordinator's decision appender, with kill-worker=coordinator@N: dies right after its N-th decision is in
    the log (what a successor must finish)."""
    decisions = 0

    def appended(*args: P.args, **kwargs: P.kwargs) -> bool:
        nonlocal decisions
        ok = append(*args, **kwargs)
        if ok:
            decisions += 1
            kill = injector.peek("kill-worker", worker="coordinator")
            if kill is not None and decisions >= kill.after:
                injector.take("kill-worker", worker="coordinator")
                raise WorkerKilled(f"coordinator killed after {decisions} decisions")
        return ok

    return appended


def mortal_scorer(score: Callable[P, Sequence[T]], injector: Injector) -> Callable[P, Sequence[T]]:
    """The reward worker's scorer, with kill-worker=reward@N: dies once N samples would have been scored, before
    their scores are appended or their entries acknowledged (a successor reclaims them)."""
    scored = 0

    def scorer(*args: P.args, **kwargs: P.kwargs) -> Sequence[T]:
        nonlocal scored
        out = score(*args, **kwargs)
        kill = injector.peek("kill-worker", worker="reward")
        if out and kill is not None and scored + len(out) >= kill.after:
            injector.take("kill-worker", worker="reward")
            raise WorkerKilled(f"reward worker killed with {len(out)} scores unappended")
        scored += len(out)
        return out

    return scorer
