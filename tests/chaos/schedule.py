"""What one chaos schedule is: a tiny run's shape, its weight transport and a list of (trigger, fault), all drawn from the seed.

A schedule is pure data with a one-line JSON form (`Schedule.to_json` / `Schedule.from_json`), printed before it runs
so that it can be replayed exactly (`run_chaos --seed S --schedules 1` draws the same one; `--schedule JSON` runs a
printed one). "Exactly" means the same faults at the same triggers with the same delays; the interleaving of the
processes is the OS's and differs from run to run.

Triggers: `after:<EventType>#<k>` fires once the k-th event of that type is in the log (read by the harness),
`at:<seconds>` fires that long after both ranks joined (RankJoined twice in the log).

Faults:
  kill:<proc>:<restart_after_s>   SIGKILL the process; the supervisor restarts it after the delay (like systemd)
  stop:<proc>:<seconds>           SIGSTOP, then SIGCONT after `seconds` (longer than a rank's heartbeat deadline)
  freeze:<rank>:<seconds>         the rank SIGSTOPs itself at the start of its next group (so it holds one); the
                                  harness SIGCONTs it `seconds` after it saw it stopped
  slow:<rank>:<seconds>           the rank's next group takes `seconds` longer, the process alive (its other threads,
                                  heartbeats included, go on): a live but slow rank must keep its group
  redis-term:<down_s>             SIGTERM redis-server, start it again over the same AOF after `down_s`
  redis-kill:<down_s>             SIGKILL redis-server, likewise
  inject:<proc>:<spec>            arm an --inject spec in that process (fires at its next opportunity: the next
                                  update for rank faults, the next step for delay-trainer; under the dist transport
                                  also kill-trainer@copy and kill-rank=R@receive, which SIGKILL the process)
  net:<proc>:<kind>:<seconds>     a network fault between that process and Redis, through its own fault proxy
                                  (tests/fault_proxy.py): latency (20 ms + up to 50 ms jitter per chunk for
                                  `seconds`), reset (every open connection reset), stall (nothing forwarded either
                                  way for `seconds`), partition (every connection, open or new, reset for `seconds`)

Process faults and network faults are drawn from separate generators (network ones from `Random("net:<seed>")`, the
dist-only kill injections from `Random("dist-kill:<seed>")`), so a seed's process faults are what they were before
either existed. Network faults stay well inside the run's recovery deadlines: a partition or stall lasts at most
5 s (a rank's claims are reclaimed after recovery.lost_after_s = 10 s, a Redis outage is given up after 60 s).

Processes: driver, coordinator, coordinator2 (the standby, in schedules with two), rank0, rank1, reward, trainer.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from typing import Literal, get_args

FaultKind = Literal["kill", "stop", "freeze", "slow", "redis-term", "redis-kill", "inject", "net"]
FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)
NetKind = Literal["latency", "reset", "stall", "partition"]
NET_KINDS: tuple[NetKind, ...] = get_args(NetKind)
NET_LATENCY_S, NET_JITTER_S = 0.02, 0.05  # a `latency` fault: each chunk waits 20 ms + uniform(0, 50 ms)

# Event types a trigger may wait for, with how many of them a tiny run produces per step (an upper bound for k).
_TRIGGER_EVENTS: dict[str, int] = {
    "GroupAdmitted": 2,
    "SampleStarted": 6,
    "SampleFinished": 6,
    "GroupCompleted": 2,
    "BatchConsumed": 1,
    "UpdateStaged": 1,
    "PrepareRequested": 1,
    "RankPrepared": 2,
    "AdmissionPaused": 1,
    "EnginePaused": 2,
    "UpdateCommitted": 1,
    "RankCommitted": 2,
    "PolicyPublished": 1,
    "TrainStepFinished": 1,
}


@dataclass(frozen=True)
class Trigger:
    event: str | None = None  # fire after the k-th event of this type ...
    k: int = 0
    at_s: float | None = None  # ... or this long after the workers started

    def render(self) -> str:
        return f"after:{self.event}#{self.k}" if self.event is not None else f"at:{self.at_s:g}"

    @staticmethod
    def parse(text: str) -> Trigger:
        kind, _, rest = text.partition(":")
        if kind == "after":
            event, _, k = rest.partition("#")
            return Trigger(event=event, k=int(k))
        if kind == "at":
            return Trigger(at_s=float(rest))
        raise ValueError(f"trigger {text!r}: expected after:<EventType>#<k> or at:<seconds>")


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    proc: str = ""  # kill, stop, inject
    seconds: float = 0.0  # kill: restart delay; stop: how long stopped; redis-*: how long down
    spec: str = ""  # inject: the --inject spec; net: the network fault's kind (NET_KINDS)

    def render(self) -> str:
        if self.kind == "net":
            return f"net:{self.proc}:{self.spec}:{self.seconds:g}"
        if self.kind in ("kill", "stop", "freeze", "slow"):
            return f"{self.kind}:{self.proc}:{self.seconds:g}"
        if self.kind == "inject":
            return f"inject:{self.proc}:{self.spec}"
        return f"{self.kind}:{self.seconds:g}"

    @staticmethod
    def parse(text: str) -> Fault:
        parts = text.split(":", 2)
        kind = parts[0]
        if kind in ("kill", "stop", "freeze", "slow") and len(parts) == 3:
            return Fault(kind, proc=parts[1], seconds=float(parts[2]))  # type: ignore[arg-type]
        if kind == "inject" and len(parts) == 3:
            return Fault("inject", proc=parts[1], spec=parts[2])
        if kind == "net":
            net = text.split(":")
            if len(net) == 4 and net[2] in NET_KINDS:
                return Fault("net", proc=net[1], spec=net[2], seconds=float(net[3]))
        if kind in ("redis-term", "redis-kill") and len(parts) == 2:
            return Fault(kind, seconds=float(parts[1]))  # type: ignore[arg-type]
        raise ValueError(f"fault {text!r}: see tests/chaos/schedule.py for the forms")


@dataclass(frozen=True)
class Step:
    trigger: Trigger
    fault: Fault

    def render(self) -> str:
        return f"{self.trigger.render()} -> {self.fault.render()}"


@dataclass(frozen=True)
class Schedule:
    seed: int
    steps: int = 2
    group_size: int = 2
    groups_per_step: int = 1
    coordinators: int = 1
    faults: tuple[Step, ...] = field(default=())
    transport: str = "directory"  # update.transport: how the weights reach the ranks
    rollout: str = "plain"  # plain, or recycle: abort drains, longer samples, recycle_aborted (harness.config_toml)

    @property
    def processes(self) -> tuple[str, ...]:
        coords = ("coordinator", "coordinator2")[: self.coordinators]
        return ("driver", *coords, "rank0", "rank1", "reward", "trainer")

    def to_json(self) -> str:
        d = asdict(self)
        d["faults"] = [s.render() for s in self.faults]
        return json.dumps(d, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> Schedule:
        d = json.loads(text)
        steps = []
        for s in d.pop("faults"):
            trig, _, fault = s.partition(" -> ")
            steps.append(Step(Trigger.parse(trig), Fault.parse(fault)))
        return Schedule(**d, faults=tuple(steps))

    @property
    def has_net_faults(self) -> bool:
        """Whether any process's Redis connection goes through a fault proxy (only then does the harness start any)."""
        return any(s.fault.kind == "net" for s in self.faults)

    def render(self) -> str:
        head = (
            f"seed {self.seed}: steps {self.steps}, group_size {self.group_size}, groups_per_step "
            f"{self.groups_per_step}, coordinators {self.coordinators}, transport {self.transport}, rollout "
            f"{self.rollout}"
        )
        return "\n".join([head, *(f"  {s.render()}" for s in self.faults)] if self.faults else [head + ", no faults"])


def _inject_spec(rng: random.Random) -> tuple[str, str]:
    """(process, spec) of one armed injection: failed and corrupt prepares, a failed commit, a slow trainer."""
    choice = rng.choice(["prepare", "transfer", "corrupt", "commit", "delay"])
    if choice == "delay":
        return "trainer", f"delay-trainer={rng.choice([1, 2, 3, 5])}"
    r = rng.randrange(2)
    if choice == "corrupt":
        return f"rank{r}", f"corrupt-rank={r}"
    return f"rank{r}", f"fail-rank={r}@{choice}"


def _dist_kill(rng: random.Random) -> tuple[str, str]:
    """(process, spec) of one of the dist transport's process kills: the trainer between its durable copy and the
    server's record of it, or a rank mid-transfer."""
    if rng.random() < 0.5:
        return "trainer", "kill-trainer@copy"
    r = rng.randrange(2)
    return f"rank{r}", f"kill-rank={r}@receive"


def _trigger(rng: random.Random, steps: int, event_share: float = 0.6) -> Trigger:
    """A trigger: `event_share` of the time after the k-th event of a type, else some seconds after both ranks
    joined. A tiny run often finishes a few seconds after its second rank joined, so a later `at:` never comes."""
    if rng.random() < event_share:
        event = rng.choice(sorted(_TRIGGER_EVENTS))
        return Trigger(event=event, k=rng.randint(1, max(1, _TRIGGER_EVENTS[event] * steps)))
    return Trigger(at_s=round(rng.uniform(0.5, 6.0), 1))  # a tiny run lasts seconds once joined


def _net_fault(rng: random.Random, procs: tuple[str, ...]) -> Fault:
    kind = rng.choice(NET_KINDS)
    proc = rng.choice(procs)
    seconds = {"latency": (2.0, 6.0), "reset": (0.0, 0.0), "stall": (0.5, 3.0), "partition": (1.0, 5.0)}[kind]
    return Fault("net", proc=proc, spec=kind, seconds=round(rng.uniform(*seconds), 1))


TRANSPORTS = ("directory", "dist")
ROLLOUTS = ("plain", "recycle")  # what a batch draws from by default
ROLLOUT_CHOICES = (*ROLLOUTS, "interruptible", "many")  # and what --rollouts may name


def draw(
    seed: int,
    kinds: tuple[FaultKind, ...] = FAULT_KINDS,
    max_faults: int = 3,
    transports: tuple[str, ...] = ("directory",),
    rollouts: tuple[str, ...] = ROLLOUTS,
) -> Schedule:
    """The schedule of `seed`: every random choice comes from `random.Random(seed)`, in a fixed order."""
    rng = random.Random(seed)
    steps = rng.choice([2, 3])
    group_size = rng.choice([2, 3, 4])
    groups_per_step = rng.choice([1, 2])
    coordinators = rng.choice([1, 1, 2])
    proc_kinds = tuple(k for k in kinds if k != "net")  # "net" is drawn below, from its own generator
    n = rng.randint(1, max_faults) if proc_kinds else 0
    out: list[Step] = []
    procs = ("driver", *("coordinator", "coordinator2")[:coordinators], "rank0", "rank1", "reward", "trainer")
    for _ in range(n):
        trigger = _trigger(rng, steps)
        kind = rng.choice(proc_kinds)
        if kind == "kill":
            fault = Fault("kill", proc=rng.choice(procs), seconds=round(rng.uniform(0.2, 3.0), 1))
        elif kind in ("stop", "freeze", "slow"):
            fault = Fault(kind, proc=f"rank{rng.randrange(2)}", seconds=round(rng.uniform(6.0, 9.0), 1))
        elif kind == "inject":
            proc, spec = _inject_spec(rng)
            fault = Fault("inject", proc=proc, spec=spec)
        else:
            fault = Fault(kind, seconds=round(rng.uniform(0.5, 3.0), 1))
        out.append(Step(trigger, fault))
    # drawn from its own generator, so a seed's shape and faults are what they were before transports were drawn
    transport = random.Random(f"transport:{seed}").choice(sorted(transports))
    if transport == "dist" and "inject" in kinds:  # the dist transport's own process kills, half the schedules
        kill = random.Random(f"dist-kill:{seed}")
        if kill.random() < 0.5:
            trigger = _trigger(kill, steps, event_share=1.0)
            proc, spec = _dist_kill(kill)
            out.append(Step(trigger, Fault("inject", proc=proc, spec=spec)))
    if "net" in kinds:  # 1..max_faults network faults when only they are asked for, else 0..2 beside the others
        net = random.Random(f"net:{seed}")
        for _ in range(net.randint(0 if proc_kinds else 1, max_faults if not proc_kinds else 2)):
            trigger = _trigger(net, steps, event_share=1.0)
            out.append(Step(trigger, _net_fault(net, procs)))
    rollout = sorted(rollouts)[seed % len(rollouts)]  # not drawn: seeds alternate, so a batch holds both halves
    return Schedule(seed, steps, group_size, groups_per_step, coordinators, tuple(out), transport, rollout)


def parse_choices(option: str, text: str, choices: tuple[str, ...]) -> tuple[str, ...]:
    """A comma list of some of `choices` (`option` names it in the error)."""
    chosen = tuple(t.strip() for t in text.split(","))
    bad = [t for t in chosen if t not in choices]
    if bad or not chosen:
        raise ValueError(f"{option}: unknown {bad}; choose from {', '.join(choices)}")
    return chosen


def parse_transports(text: str) -> tuple[str, ...]:
    """`--transports`: a comma list of update.transport values."""
    return parse_choices("--transports", text, TRANSPORTS)


def parse_kinds(text: str) -> tuple[FaultKind, ...]:
    """`--faults`: `all`, `none`, or a comma list of fault kinds."""
    if text == "all":
        return FAULT_KINDS
    if text == "none":
        return ()
    kinds = tuple(k.strip() for k in text.split(","))
    bad = [k for k in kinds if k not in FAULT_KINDS]
    if bad:
        raise ValueError(f"--faults: unknown kind(s) {bad}; choose from {', '.join(FAULT_KINDS)}, all, none")
    return kinds  # type: ignore[return-value]
