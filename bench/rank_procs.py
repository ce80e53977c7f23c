"""Rank processes for the weight benchmarks, driven in lock step (bench_update.py, bench_transport.py).

Each rank is a spawned process running `target(conn, *args)`: it sends ("ready", 0.0, None) once set up, then
answers every (command, argument) it receives with (command, seconds it took, detail) until ("exit", None).
A phase starts on every rank at once and ends when all have answered, within `deadline_s`.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import time
from collections.abc import Callable, Sequence
from typing import Any


class RankProcesses:
    """N rank processes; `run(cmd)` times one lock-step phase."""

    def __init__(
        self, target: Callable[..., None], args_per_rank: Sequence[tuple[Any, ...]], deadline_s: float
    ) -> None:
        ctx = mp.get_context("spawn")
        self.deadline_s = deadline_s
        self.conns: list[multiprocessing.connection.Connection] = []
        self.procs: list[Any] = []
        for args in args_per_rank:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=target, args=(child, *args), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.collect("ready")

    def send(self, cmd: str, args: Sequence[Any] | None = None) -> None:
        """Start `cmd` on every rank (`args`: one argument per rank; None for none)."""
        for i, c in enumerate(self.conns):
            c.send((cmd, None if args is None else args[i]))

    def collect(self, cmd: str) -> list[tuple[float, Any]]:
        """Each rank's (seconds, detail) for `cmd`; TimeoutError when one has not answered within the deadline."""
        out = []
        deadline = time.monotonic() + self.deadline_s
        for c in self.conns:
            if not c.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"a rank did not finish {cmd!r} within {self.deadline_s:g} s")
            name, secs, detail = c.recv()
            assert name == cmd, (name, cmd, detail)
            out.append((secs, detail))
        return out

    def run(self, cmd: str, args: Sequence[Any] | None = None) -> tuple[float, list[tuple[float, Any]]]:
        """Wall seconds until every rank has done `cmd`, and each rank's own (seconds, detail)."""
        t0 = time.perf_counter()
        self.send(cmd, args)
        per_rank = self.collect(cmd)
        return time.perf_counter() - t0, per_rank

    def close(self) -> None:
        for c in self.conns:
            c.send(("exit", None))
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
