"""Crash recovery of the coordinator on a real redis-server, the ranks played by hand.

A coordinator killed (kill-worker=coordinator@N) after PrepareRequested and before any decision is replaced; its
successor, holding a larger fencing token, aborts the open transaction at its deadline - not before, and never
commits it, even though every rank prepared meanwhile. One killed after UpdateCommitted is replaced and the
successor rolls the decision forward to PolicyPublished (quarantining a rank whose swap failed).
"""

from __future__ import annotations

import redis
from test_coordinator_election import Harness, config, stop

from rolledger.schemas import events as ev
from rolledger.schemas.injection import parse_injection
from rolledger.workers.operator.faults import Injector, mortal_coordinator
from rolledger.workers.roles.coordinator import Coordinator
from rolledger.workers.runtime.runtime import WorkerKilled


def killed_after(h: Harness, decisions: int) -> Coordinator:
    """A coordinator (no prompts: its only decisions are the update's) that dies right after its n-th decision."""
    injector = Injector([parse_injection(f"kill-worker=coordinator@{decisions}")])
    c = Coordinator(h.client, h.run_id, "coordinator", [], lease_ttl_ms=300)
    c.append_decisions = mortal_coordinator(c.append_decisions, injector)
    return c


def wait_dead(c: Coordinator) -> None:
    c.join(timeout=30)
    assert not c.alive and isinstance(c.error, WorkerKilled), c.error


def test_a_coordinator_lost_before_deciding_is_replaced_and_the_transaction_aborts_at_its_deadline(
    redis_client: redis.Redis, run_id: str
) -> None:
    h = Harness(redis_client, run_id, config(ranks=2, prepare_deadline_s=3.0))
    h.stage(1)
    first = killed_after(h, 1)
    first.start()
    asked = h.wait_type(ev.PrepareRequested, version=1)
    wait_dead(first)
    assert h.lease_holder() == first.name  # died holding the lease
    for r in range(2):  # every rank prepares: the dead coordinator would have committed
        h.prepared(1, r)
    second = first.respawn()
    second.start()
    try:
        aborted = h.wait_type(ev.UpdateAborted, version=1)
    finally:
        stop(second)
    p = asked.payload
    assert isinstance(p, ev.PrepareRequested) and isinstance(aborted.payload, ev.UpdateAborted)
    assert aborted.producer == second.name and aborted.payload.fence == p.fence + 1
    assert aborted.wall_time > p.deadline  # at its deadline, not before
    assert "lost before deciding" in aborted.payload.reason
    log = h.events()
    assert not [e for e in log if isinstance(e.payload, ev.UpdateCommitted)]  # never committed
    # the successor never drove the transaction it did not open (no pause for it either)
    assert not [e for e in log if e.producer == second.name and not isinstance(e.payload, ev.UpdateAborted)]


def test_a_coordinator_lost_after_the_commit_is_replaced_and_the_update_rolls_forward(
    redis_client: redis.Redis, run_id: str
) -> None:
    h = Harness(redis_client, run_id, config(ranks=2))
    h.stage(1)
    first = killed_after(h, 3)  # PrepareRequested, AdmissionPaused(update), UpdateCommitted
    first.start()
    h.wait_type(ev.PrepareRequested, version=1)
    for r in range(2):
        h.prepared(1, r)
    h.wait_type(ev.AdmissionPaused, reason="update")
    for r in range(2):
        h.drained(r)
    committed = h.wait_type(ev.UpdateCommitted, version=1)
    wait_dead(first)
    h.swapped(1, 0)  # the ranks act on the logged commit while no coordinator lives
    h.swapped(1, 1, healthy=False)
    second = first.respawn()
    second.start()
    try:
        published = h.wait_type(ev.PolicyPublished, version=1)
        h.wait_type(ev.AdmissionResumed, reason="update")
    finally:
        stop(second)
    assert isinstance(committed.payload, ev.UpdateCommitted) and isinstance(published.payload, ev.PolicyPublished)
    assert published.producer == second.name and published.payload.fence == committed.payload.fence + 1
    assert published.payload.ranks == (0,) and published.payload.weights_digest == "w0001"
    log = h.events()
    quarantined = [e.payload for e in log if isinstance(e.payload, ev.RankQuarantined)]
    assert [(q.rank, q.version) for q in quarantined] == [(1, 1)]
    assert not [e for e in log if isinstance(e.payload, ev.UpdateAborted)]  # the logged decision stands
    assert sum(isinstance(e.payload, ev.UpdateCommitted) for e in log) == 1  # and is not taken again
