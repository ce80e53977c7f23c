"""Fault injection at run time: the run's pending injections, and the wrappers that make them fire.

The vocabulary (`--inject` specs) is `rolledger.schemas.injection`. Workers never test for faults themselves: a
faulty engine, a faulty staging store or a faulty trainer step wraps the real one and fires the matching injection
once, at its first opportunity.
"""

from __future__ import annotations

from rolledger.schemas.injection import Injection


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
