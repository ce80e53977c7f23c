"""The coordinator process: an interpreter of `workflows.coordinator.decide` - follow the log, hold the leader lease,
decide, append the decisions conditionally on the log not having moved since it decided, snapshot.

Decisions are appended with `append_if(expected last entry)`: a decision taken on a stale view is refused and taken
again on the fresh one, and a second coordinator without the lease never decides at all. Every update decision
carries the lease's fencing token. A coordinator that starts after a crash rebuilds the state from the log and goes on
from there: an update with no decision logged is aborted at its deadline; a committed one is rolled forward.

This is the only writer of the run's end (RunFinished of every status, the halt). A driver that must end a run whose
coordinator is gone for good uses `finish_as_coordinator`: it takes the same lease (waiting out the dead holder's TTL)
and appends `decide_terminal`'s decision through the same conditional path. Faults wrap `append_decisions`
(workers/operator/faults.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import redis

from rolledger.events.lease import LeaderLease
from rolledger.events.snapshots import SnapshotWriter, latest_snapshot
from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
from rolledger.workers.runtime.runtime import Emitter, Follower, Worker
from rolledger.workflows.admission import AdmissionInputs
from rolledger.workflows.coordinator import DURABLE_DECISIONS, decide, decide_terminal
from rolledger.workflows.replay import restore
from rolledger.workflows.scheduler import PromptItem
from rolledger.workflows.state import RunState

DecisionAppender = Callable[[Sequence[ev.Payload], str, int], bool]


class Coordinator(Worker):
    kind = "coordinator"

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        name: str,
        prompts: Sequence[PromptItem],
        *,
        lease_ttl_ms: int = 3000,
        snapshot_every: int = 500,
        snapshot_every_s: float = 30.0,
    ) -> None:
        super().__init__(client, run_id, name)
        self.prompts = list(prompts)
        self.follower = Follower(self.log)
        snap = latest_snapshot(client, run_id)
        if snap is not None:  # a restarted coordinator resumes from the latest snapshot plus the tail after it
            self.follower.start_from(restore(snap), snap.stream_id)
        self.lease = LeaderLease(client, run_id, "coordinator", name, ttl_ms=lease_ttl_ms)
        self.decisions = 0
        # snapshots every `snapshot_every` events (stretched so a snapshot costs at most 2 us of CPU per event) or
        # `snapshot_every_s` seconds, digested and written on their own thread: the decision thread only copies the
        # (bounded) live state
        self.snapshots = SnapshotWriter(
            client,
            run_id,
            every_events=snapshot_every,
            every_s=snapshot_every_s,
            events_at_start=self.follower.state.events_applied,  # 0, or the snapshot it started from
        )
        # (payloads, expected last stream id, policy version) -> appended?; a fault wrapper may replace it
        self.append_decisions: DecisionAppender = self._append_decisions

    def respawn(self) -> Coordinator:
        """A new coordinator: it rebuilds the state from the log, takes the lease when the old one expires (a larger
        fencing token) and finishes whatever the dead one left open."""
        return Coordinator(self.client, self.run_id, self.next_name(), self.prompts, lease_ttl_ms=self.lease.ttl_ms)

    def run(self) -> None:
        renew_at = 0.0
        while not self.stop_event.is_set():
            self.follower.poll(block_ms=50)
            state = self.follower.state
            if state.status.is_terminal:
                break
            if self.lease.token is not None and self.snapshots.due(state.events_applied):
                started = time.thread_time()
                frozen = state.frozen()
                self.snapshots.submit(
                    frozen, self.follower.last_id, state.events_applied, copy_cost_s=time.thread_time() - started
                )
            now = time.time()
            if self.lease.token is None or now >= renew_at:
                if self.lease.acquire() is None:  # takes a free lease or extends ours
                    continue  # another coordinator leads; keep following so we can take over
                renew_at = now + self.lease.ttl_ms / 3000
            fence = self.lease.token
            assert fence is not None
            payloads = decide(state, now, fence, AdmissionInputs(now=now, prompts=self.prompts))
            if payloads:
                self.append_decisions(payloads, self.follower.last_id, state.policy_version)
        self.lease.release()
        if not self.snapshots.close(timeout_s=10.0):
            self.logger.warning("the last snapshot was not written within 10 s")

    def _append_decisions(self, payloads: Sequence[ev.Payload], expected_last_id: str, policy_version: int) -> bool:
        """Append if the log still ends where we decided; wait for the AOF after an update decision."""
        if not self.emitter.emit_if(payloads, expected_last_id=expected_last_id, policy_version=policy_version):
            return False
        self.decisions += 1
        if any(isinstance(p, DURABLE_DECISIONS) for p in payloads) and not self.log.wait_durable(timeout_ms=1000):
            # the decision stands (it is in the log); say that a host crash could still lose it
            self.logger.warning(
                "update decision not known durable (AOF off, or appendfsync no: safe from a redis-server crash, not "
                "from an OS crash; see EventLog.wait_durable)",
                decisions=[p.type for p in payloads],
            )
        return True


def finish_as_coordinator(
    client: redis.Redis,
    run_id: str,
    holder: str,
    decide_end: Callable[[RunState, float], list[ev.Payload]] = decide_terminal,
    *,
    ttl_ms: int = 3000,
    timeout_s: float = 30.0,
) -> bool:
    """End a run whose coordinator is gone: take the coordinator lease as `holder` (a new, larger fencing token, once
    the dead holder's TTL ran out), fold the log, and append `decide_end`'s decisions with `append_if`, re-deciding on
    a conflict. True once the run is over (by us or anyone), False if the lease or the decision did not come in time.
    """
    log = EventLog(client, run_id)
    follower = Follower(log)
    emitter = Emitter(log, holder)
    lease = LeaderLease(client, run_id, "coordinator", holder, ttl_ms=ttl_ms)
    give_up = time.monotonic() + timeout_s
    try:
        while time.monotonic() < give_up:
            follower.catch_up()
            state = follower.state
            if state.status.is_terminal:
                return True
            if lease.acquire() is None:
                follower.poll(block_ms=100)  # someone holds the lease: wait on the log, not on a sleep
                continue
            payloads = decide_end(state, time.time())
            if not payloads:
                return False  # nothing says the run must end
            if emitter.emit_if(payloads, expected_last_id=follower.last_id, policy_version=state.policy_version):
                follower.catch_up()
                return follower.state.status.is_terminal
        return False
    finally:
        lease.release()
