"""One dispatch style for every fold of the log: a registry of handlers keyed by payload class.

    handlers: Handlers[MyContext, None] = Handlers("my fold")

    @handlers.on(ev.SampleFinished)
    def _finished(ctx: MyContext, e: ev.Event, p: ev.SampleFinished) -> None: ...

    for event in log:
        handlers.apply(ctx, event)

A handler gets the fold's context, the event and its payload, typed as the class it was registered for. One handler
for several classes takes their union and is registered once per class: `handlers.on(ev.A)(fn)`, `handlers.on(ev.B)(fn)`
(each registration checks that `fn` accepts that class). `apply` is one dict lookup on the payload's
class: the reducer's hot path pays nothing more. Events of a class with no handler are skipped by `apply` (a fold
that must handle every type says so with `require_all`). `merge` joins the registries of one fold split across
modules (the reducer's event families), refusing a class handled twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from rolledger.schemas.events import PAYLOAD_TYPES, Event, Payload

C = TypeVar("C")  # the fold's context (the state it updates)
R = TypeVar("R")  # what a handler returns (None for most folds)
P = TypeVar("P", bound=Payload)

Handler = Callable[[C, Event, P], R]


class Handlers(Generic[C, R]):
    """Handlers of one fold, by payload class."""

    __slots__ = ("name", "table")

    def __init__(self, name: str) -> None:
        self.name = name
        self.table: dict[type[Payload], Callable[[C, Event, Any], R]] = {}

    def on(self, cls: type[P]) -> Callable[[Handler[C, P, R]], Handler[C, P, R]]:
        """Register the decorated function as the handler of payloads of `cls`."""

        def register(fn: Handler[C, P, R]) -> Handler[C, P, R]:
            if cls in self.table:
                raise ValueError(f"{self.name}: {cls.__name__} already has a handler")
            self.table[cls] = fn
            return fn

        return register

    def apply(self, ctx: C, event: Event) -> R | None:
        """Run the handler of the event's payload class; None (and nothing done) when it has none."""
        payload = event.payload
        fn = self.table.get(type(payload))
        return None if fn is None else fn(ctx, event, payload)

    def handles(self, event: Event) -> bool:
        return type(event.payload) in self.table

    def require_all(self) -> None:
        """Raise ImportError unless every payload type has a handler (for folds that must see every event)."""
        missing = sorted(name for name, cls in PAYLOAD_TYPES.items() if cls not in self.table)
        if missing:
            raise ImportError(f"{self.name} has no handler for {missing}")

    @classmethod
    def merge(cls, name: str, *parts: Handlers[C, R]) -> Handlers[C, R]:
        """One registry from several (a fold split across modules); a class handled by two parts is refused."""
        out: Handlers[C, R] = cls(name)
        for part in parts:
            for payload_cls, fn in part.table.items():
                if payload_cls in out.table:
                    raise ValueError(f"{name}: {payload_cls.__name__} handled by two parts")
                out.table[payload_cls] = fn
        return out
