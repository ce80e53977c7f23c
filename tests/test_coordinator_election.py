"""Leader election of the coordinator on a real redis-server: two `workers.roles.coordinator.Coordinator` threads started at
once on one run decide through one leader lease. Exactly one of them decides (one producer, one fencing token); when
it dies without giving the lease up, the other takes over once the lease expires, with a larger token.

The test plays the trainer and the rank by appending their events by hand; no staging store and no engine are
needed by the coordinator. Every wait polls the log with a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from rolledger.events.envelope import make_event
from rolledger.events.keys import lease_key
from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.schemas.statuses import CacheKind, DrainMode
from rolledger.workers.roles.coordinator import Coordinator
from rolledger.workflows.scheduler import PromptItem

PROMPTS = [PromptItem(i, f"p{i}", (1, 2, 3), "5") for i in range(4)]


def config(*, ranks: int = 1, prepare_deadline_s: float = 60.0) -> RunConfig:
    return RunConfig.model_validate(
        {
            "ranks": ranks,
            "group_size": 2,
            "steps": 5,
            "update": {"prepare_deadline_s": prepare_deadline_s, "drain_deadline_s": 60, "commit_deadline_s": 60},
        }
    )


class Harness:
    """One run's log, with the trainer and the ranks played by hand."""

    def __init__(self, client: redis.Redis, run_id: str, cfg: RunConfig) -> None:
        self.client = client
        self.run_id = run_id
        self.cfg = cfg
        self.log = EventLog(client, run_id)
        self.emit(ev.RunStarted(config=cfg, initial_weights_digest="w0000"), "run")
        for r in range(cfg.ranks):
            self.emit(ev.RankJoined(rank=r, engine="hand", policy_version=0, weights_digest="w0000"), f"rank-{r}")

    def emit(self, payload: ev.Payload, producer: str) -> None:
        self.log.append(make_event(payload, run_id=self.run_id, producer=producer, policy_version=0))

    def events(self) -> list[ev.Event]:
        return [s.event for s in self.log.read()]

    def wait_for(self, what: str, predicate: Callable[[ev.Event], bool], deadline_s: float = 30.0) -> ev.Event:
        """The first event matching `predicate`, polling the log until the deadline."""
        deadline = time.monotonic() + deadline_s
        while True:
            found = [e for e in self.events() if predicate(e)]
            if found:
                return found[0]
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {deadline_s}s waiting for {what}; log: {[e.type for e in self.events()]}"
                )
            time.sleep(0.02)  # polling the log with a deadline, not synchronising

    def wait_type(self, cls: type, deadline_s: float = 30.0, **fields: object) -> ev.Event:
        def match(e: ev.Event) -> bool:
            return isinstance(e.payload, cls) and all(getattr(e.payload, k) == v for k, v in fields.items())

        return self.wait_for(f"{cls.__name__} {fields}", match, deadline_s)

    # ------------------------------------------------------------ the trainer and the ranks
    def stage(self, v: int) -> None:
        self.emit(
            ev.UpdateStaged(
                version=v,
                base_version=v - 1,
                manifest_digest=f"m{v:04d}",
                weights_digest=f"w{v:04d}",
                uri=f"file:///nowhere/v{v}",
                bytes=4096,
                tensors=1,
            ),
            "trainer",
        )

    def prepared(self, v: int, rank: int) -> None:
        self.emit(
            ev.RankPrepared(version=v, rank=rank, manifest_digest=f"m{v:04d}", staged_digest=f"w{v:04d}"),
            f"rank-{rank}",
        )

    def drained(self, rank: int) -> None:
        self.emit(ev.EnginePaused(rank=rank, mode=DrainMode.WAIT), f"rank-{rank}")

    def swapped(self, v: int, rank: int, *, healthy: bool = True) -> None:
        if not healthy:
            self.emit(ev.HealthFailed(rank=rank, version=v, reason="probe produced NaN"), f"rank-{rank}")
            return
        self.emit(ev.RankCommitted(version=v, rank=rank, weights_digest=f"w{v:04d}"), f"rank-{rank}")
        self.emit(ev.CacheInvalidated(rank=rank, kind=CacheKind.PREFIX, generation=v, version=v), f"rank-{rank}")
        self.emit(ev.HealthPassed(rank=rank, version=v, weights_digest=f"w{v:04d}", probe_digest="p"), f"rank-{rank}")

    def run_update(self, v: int) -> None:
        """Play every rank through the transaction of v, waiting for each coordinator decision in turn."""
        self.wait_type(ev.PrepareRequested, version=v)
        for r in range(self.cfg.ranks):
            self.prepared(v, r)
        self.wait_for(
            f"AdmissionPaused(update) for v{v}",
            lambda e: (
                isinstance(e.payload, ev.AdmissionPaused) and e.payload.reason == "update" and self._after_prepare(e, v)
            ),
        )
        for r in range(self.cfg.ranks):
            self.drained(r)
        self.wait_type(ev.UpdateCommitted, version=v)
        for r in range(self.cfg.ranks):
            self.swapped(v, r)
        self.wait_type(ev.PolicyPublished, version=v)

    def _after_prepare(self, e: ev.Event, v: int) -> bool:
        ids = [x.event_id for x in self.events()]
        asked = next(
            x.event_id for x in self.events() if isinstance(x.payload, ev.PrepareRequested) and x.payload.version == v
        )
        return ids.index(e.event_id) > ids.index(asked)

    def lease_holder(self) -> str | None:
        value = self.client.get(lease_key(self.run_id, "coordinator"))
        if value is None:
            return None
        return (value.decode() if isinstance(value, bytes) else str(value)).rsplit("#", 1)[0]


def decisions(events: list[ev.Event], producers: set[str]) -> list[ev.Event]:
    return [e for e in events if e.producer in producers]


def fences(events: list[ev.Event]) -> set[int]:
    return {e.payload.fence for e in events if hasattr(e.payload, "fence")}


def stop(*coordinators: Coordinator) -> None:
    for c in coordinators:
        c.stop()
    for c in coordinators:
        c.join(timeout=30)


def crash(c: Coordinator) -> None:
    """Stop the thread the way a killed process stops: the lease is left to expire, not released."""
    c.lease.release = lambda: None  # type: ignore[method-assign]  # disarmed, as a crash never releases
    c.stop()
    c.join(timeout=30)
    assert not c.alive


def test_two_coordinators_one_leader_and_the_other_takes_over_with_a_larger_fence(
    redis_client: redis.Redis, run_id: str
) -> None:
    h = Harness(redis_client, run_id, config())
    h.stage(1)
    a = Coordinator(redis_client, run_id, "coord-a", PROMPTS, lease_ttl_ms=2000)
    b = Coordinator(redis_client, run_id, "coord-b", PROMPTS, lease_ttl_ms=2000)
    a.start()
    b.start()
    try:
        h.run_update(1)
        h.wait_type(ev.AdmissionResumed, reason="update")
        before = decisions(h.events(), {a.name, b.name})
        leaders = {e.producer for e in before}
        assert len(leaders) == 1, f"decisions from {leaders}"  # exactly one decides
        leader, other = (a, b) if a.name in leaders else (b, a)
        assert len(fences(before)) == 1 and other.alive and other.error is None and other.decisions == 0
        assert any(isinstance(e.payload, ev.GroupAdmitted) for e in before)  # admission is the leader's alone too
        old_fence = fences(before).pop()

        crash(leader)
        assert h.lease_holder() == leader.name  # not released: the other must wait for it to expire
        h.stage(2)
        h.run_update(2)
        after = decisions(h.events(), {a.name, b.name})[len(before) :]
        assert {e.producer for e in after} == {other.name}
        assert fences(after) == {old_fence + 1}  # a new tenure, a larger token, on every update decision
        assert h.lease_holder() == other.name and other.decisions > 0
        assert other.lease.current_token() == old_fence + 1
    finally:
        stop(a, b)


def test_three_contenders_never_interleave_decisions(redis_client: redis.Redis, run_id: str) -> None:
    """While the leader lives, the followers never append: one producer and one token from start to publish."""
    h = Harness(redis_client, run_id, config(ranks=2))
    h.stage(1)
    coords = [Coordinator(redis_client, run_id, f"coord-{i}", PROMPTS, lease_ttl_ms=2000) for i in range(3)]
    for c in coords:
        c.start()
    try:
        h.run_update(1)
        made = decisions(h.events(), {c.name for c in coords})
        assert len({e.producer for e in made}) == 1 and len(fences(made)) == 1
        assert all(c.alive and c.error is None for c in coords)
    finally:
        stop(*coords)
