"""Fault-injection specs (`--inject`), parsed into typed values: the one vocabulary of faults. Each fires once, at
its first opportunity; the wrappers that make them happen live in `rolledger.workers.operator.faults`.

fail-rank=R@prepare|transfer|commit   rank R fails that phase the next time it runs it: an update's, or for prepare
                                      and transfer also the read-back of a rejoin or reload (whichever comes first)
corrupt-rank=R                        rank R sees a checksum mismatch in the next staged file
kill-worker=KIND@N                    the KIND worker (rollout|reward|trainer|coordinator) dies after N units
delay-trainer=SECONDS                 the trainer sleeps SECONDS before each step
stale-weights=R                       rank R reports the commit but keeps serving the old weights
noop-transport=R                      rank R's next dist transfer moves nothing (a communicator that disabled itself)
kill-trainer@copy                     dist: the trainer process is SIGKILLed between its durable copy and its record
                                      (after writing its copy of the next version it stages, before the weight
                                      server records that the copy is in place); in a `rolledger worker` process only
kill-rank=R@receive                   dist: rank R's process is SIGKILLed after the first bucket of its next transfer

`check_injections` refuses, before a run starts, an injection that could never fire in it (a rank the run does not
have, a non-finite or negative delay, a kill after zero units, a fault for a worker the run does not start here).
The two process kills (kill-trainer@copy, kill-rank=R@receive) SIGKILL a `rolledger worker` process: the chaos
harness arms them there (tests/chaos, `inject:<proc>:<spec>`); a run whose workers are threads of one process refuses
them, and so does a run under the directory transport.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, get_args

from rolledger.schemas.config import RunConfig

InjectionKind = Literal[
    "fail-rank",
    "corrupt-rank",
    "kill-worker",
    "delay-trainer",
    "stale-weights",
    "noop-transport",
    "kill-trainer",
    "kill-rank",
]
WorkerKind = Literal["rollout", "reward", "trainer", "coordinator"]  # the workers kill-worker can name
WORKER_KINDS: tuple[WorkerKind, ...] = get_args(WorkerKind)
Phase = Literal["prepare", "transfer", "commit"]
PHASES: tuple[Phase, ...] = get_args(Phase)

_RE = re.compile(r"^(?P<kind>[a-z-]+)(?:=(?P<value>[^@]+))?(?:@(?P<at>.+))?$")
PROCESS_KILLS = ("kill-trainer", "kill-rank")  # kinds that SIGKILL the process they fire in


@dataclass(frozen=True)
class Injection:
    kind: InjectionKind
    rank: int | None = None
    phase: Phase | None = None
    worker: WorkerKind | None = None
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
        if self.kind == "kill-trainer":
            return "kill-trainer@copy"
        if self.kind == "kill-rank":
            return f"kill-rank={self.rank}@receive"
        return f"{self.kind}={self.rank}"

    @property
    def fired_by(self) -> WorkerKind:
        """The worker whose wrapper fires this injection (rank faults: the rank's rollout worker)."""
        if self.kind == "kill-worker":
            assert self.worker is not None
            return self.worker
        return "trainer" if self.kind in ("delay-trainer", "kill-trainer") else "rollout"


def parse_injection(spec: str) -> Injection:
    """Parse one --inject spec; a ValueError says what is wrong with it."""
    m = _RE.match(spec.strip())
    if not m:
        raise ValueError(f"--inject {spec!r}: expected KIND=VALUE[@WHERE]")
    kind, value, at = m["kind"], m["value"], m["at"]
    if kind == "kill-trainer":
        if value is not None or at != "copy":
            raise ValueError(f"--inject {spec!r}: expected kill-trainer@copy")
        return Injection("kill-trainer", worker="trainer")
    if value is None:
        raise ValueError(f"--inject {spec!r}: expected KIND=VALUE[@WHERE]")
    try:
        if kind == "kill-rank":
            if at != "receive":
                raise ValueError("expected kill-rank=R@receive")
            return Injection("kill-rank", rank=int(value))
        if kind == "fail-rank":
            if at not in PHASES:
                raise ValueError("the phase after @ must be prepare, transfer or commit")
            return Injection("fail-rank", rank=int(value), phase=at)
        if kind == "corrupt-rank":
            return Injection("corrupt-rank", rank=int(value))
        if kind == "stale-weights":
            return Injection("stale-weights", rank=int(value))
        if kind == "noop-transport":
            return Injection("noop-transport", rank=int(value))
        if kind == "kill-worker":
            if value not in WORKER_KINDS:
                raise ValueError("KIND must be rollout, reward, trainer or coordinator")
            return Injection("kill-worker", worker=value, after=int(at or 1))
        if kind == "delay-trainer":
            return Injection("delay-trainer", seconds=float(value))
    except ValueError as exc:
        raise ValueError(f"--inject {spec!r}: {exc}") from None
    kinds = get_args(InjectionKind)
    close = difflib.get_close_matches(kind, kinds, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"the kinds: {', '.join(kinds)}"
    raise ValueError(f"--inject {spec!r}: unknown kind {kind!r}; {hint}")


def check_injections(injections: Iterable[Injection], config: RunConfig, *, in_process: bool = True) -> None:
    """Refuse an injection that cannot fire in a run of `config`: a ValueError naming the spec and why.

    `in_process`: whether this process starts the run's workers (with --external-workers it starts none, and the
    worker processes take no injections, so no fault could fire).
    """
    for inj in injections:
        why = _cannot_fire(inj, config, in_process)
        if why is not None:
            raise ValueError(f"--inject {inj.spec!r} cannot fire: {why}")


def _cannot_fire(inj: Injection, config: RunConfig, in_process: bool) -> str | None:
    if not in_process:
        return f"this run starts no {inj.fired_by} worker here (its workers are external processes)"
    if inj.rank is not None and not 0 <= inj.rank < config.ranks:
        return f"rank {inj.rank} does not exist (the run has {config.ranks} rank(s), 0 to {config.ranks - 1})"
    if inj.kind == "delay-trainer" and not (math.isfinite(inj.seconds) and inj.seconds >= 0):
        return "the delay must be a finite number of seconds >= 0"
    dist_fault = inj.kind in ("noop-transport", *PROCESS_KILLS)
    if dist_fault and config.update.transport != "dist":
        return "it is a fault of the dist transport; this run's update.transport is directory"
    if inj.kind in ("noop-transport", "kill-rank") and config.engine != "torch":
        return "a vLLM rank's workers receive the weights themselves; this fault is armed in the torch engine only"
    if inj.kind in PROCESS_KILLS:
        return (
            f"it SIGKILLs the {inj.fired_by if inj.kind == 'kill-trainer' else 'rank'}'s process, and this run's "
            "workers are threads of this one; the chaos harness arms it in a `rolledger worker` process "
            f"(tests/chaos: inject:<proc>:{inj.spec})"
        )
    if inj.kind == "kill-worker" and inj.after < 1:
        return f"a worker dies after N >= 1 units of work, not {inj.after}"
    return None
