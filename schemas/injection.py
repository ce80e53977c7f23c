"""Fault-injection specs (`--inject`), parsed into typed values: the one vocabulary of faults. Each fires once, at
its first opportunity; the wrappers that make them happen live in `rolledger.workers.faults`.

fail-rank=R@prepare|transfer|commit   rank R fails that phase of the next update
corrupt-rank=R                        rank R sees a checksum mismatch in the next staged file
kill-worker=KIND@N                    the KIND worker (rollout|reward|trainer|coordinator) dies after N units
delay-trainer=SECONDS                 the trainer sleeps SECONDS before each step
stale-weights=R                       rank R reports the commit but keeps serving the old weights
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

_RE = re.compile(r"^(?P<kind>[a-z-]+)=(?P<value>[^@]+)(?:@(?P<at>.+))?$")


@dataclass(frozen=True)
class Injection:
    kind: Literal["fail-rank", "corrupt-rank", "kill-worker", "delay-trainer", "stale-weights"]
    rank: int | None = None
    phase: Literal["prepare", "transfer", "commit"] | None = None
    worker: str | None = None
    after: int = 0
    seconds: float = 0.0

    @property
    def spec(self) -> str:
        if self.kind == "fail-rank":
            return f"fail-rank={self.rank}@{self.phase}"
        if self.kind == "kill-worker":
            return f"kill-worker={self.worker}@{self.after}"
        if self.kind == "delay-trainer":
            return f"delay-trainer={self.seconds:g}"
        return f"{self.kind}={self.rank}"


def parse_injection(spec: str) -> Injection:
    """Parse one --inject spec; a ValueError says what is wrong with it."""
    m = _RE.match(spec.strip())
    if not m:
        raise ValueError(f"--inject {spec!r}: expected KIND=VALUE[@WHERE]")
    kind, value, at = m["kind"], m["value"], m["at"]
    try:
        if kind == "fail-rank":
            if at not in ("prepare", "transfer", "commit"):
                raise ValueError("the phase after @ must be prepare, transfer or commit")
            return Injection("fail-rank", rank=int(value), phase=at)  # type: ignore[arg-type]
        if kind in ("corrupt-rank", "stale-weights"):
            return Injection(kind, rank=int(value))  # type: ignore[arg-type]
        if kind == "kill-worker":
            if value not in ("rollout", "reward", "trainer", "coordinator"):
                raise ValueError("KIND must be rollout, reward, trainer or coordinator")
            return Injection("kill-worker", worker=value, after=int(at or 1))
        if kind == "delay-trainer":
            return Injection("delay-trainer", seconds=float(value))
    except ValueError as exc:
        raise ValueError(f"--inject {spec!r}: {exc}") from None
    raise ValueError(f"--inject {spec!r}: unknown kind {kind!r}")
