"""The coordinator process: follows the log, and under a leader lease appends the decisions of the pure coordinators
(weight update, group completion, admission) conditionally on the log not having moved since it decided.

Decisions are appended with `append_if(expected last entry)`: a decision taken on a stale view is refused and taken
again on the fresh one, and a second coordinator without the lease never decides at all. Every update decision
carries the lease's fencing token. A coordinator that starts after a crash rebuilds the state from the log and goes on
from there: an update with no decision logged is aborted at its deadline; a committed one is rolled forward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis

from rolledger.events.lease import LeaderLease
from rolledger.events.snapshots import latest_snapshot, take_snapshot
from rolledger.schemas import events as ev
from rolledger.workers.faults import Injector
from rolledger.workers.runtime import Follower, Worker, WorkerKilled
from rolledger.workflows.admission import AdmissionInputs, decide_admission
from rolledger.workflows.groups import decide_groups
from rolledger.workflows.handoff import decide_handoff
from rolledger.workflows.replay import restore
from rolledger.workflows.scheduler import PromptItem
from rolledger.workflows.state import RunState
from rolledger.workflows.update import decide_update

# Decisions whose loss in a host crash would let a restarted coordinator decide differently: wait for the AOF.
DURABLE_DECISIONS = (ev.UpdateCommitted, ev.UpdateAborted, ev.PolicyPublished)


def decide_run_end(state: RunState) -> list[ev.Payload]:
    """Once the trainer has taken its last step and no update is open: cancel what is still in flight, then finish."""
    cfg = state.config
    if cfg is None or state.status != "running" or state.trainer.step < cfg.steps or state.open_update is not None:
        return []
    out: list[ev.Payload] = []
    if "manual" not in state.admission.paused:
        out.append(ev.AdmissionPaused(reason="manual", detail="run reached its last step"))
    if any(r.status == "asleep" for r in state.ranks.values()):
        return out  # a colocated rank is still waking up after the last update
    open_groups = [g for g in state.groups.values() if g.status in ("admitted", "generating")]
    for g in open_groups:
        out.append(ev.GroupCancelled(group_id=g.group_id, reason="run finished"))
    unsettled = any(s.status == "started" for g in state.groups.values() for s in g.samples.values())
    unsettled |= any(r.status == "paused" for r in state.ranks.values())  # let ranks resume after the last publish
    if not open_groups and not unsettled:
        out.append(ev.RunFinished(status="completed", steps=state.trainer.step))
    return out


def decide(state: RunState, now: float, fence: int, inputs: AdmissionInputs) -> list[ev.Payload]:
    """Every coordinator's decision on this state, in priority order (updates, groups, the run's end, admission)."""
    if state.status != "running" or state.config is None:
        return []
    missing = [r for r in range(state.config.ranks) if r not in state.ranks]
    if missing:  # nothing is admitted or updated before every rank has joined: a run on fewer ranks is another run
        if now > state.first_wall_time + state.config.join_deadline_s:
            return [
                ev.RunFinished(
                    status="failed", reason=f"ranks {missing} did not join within {state.config.join_deadline_s:g} s"
                )
            ]
        return []
    out: list[ev.Payload] = decide_update(state, now, fence)
    out += decide_groups(state, now)
    out += decide_handoff(state)
    end = decide_run_end(state)
    out += end
    if not out and not end:
        out += decide_admission(state, inputs)
    return out


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
        injector: Injector | None = None,
        snapshot_every: int = 500,
    ) -> None:
        super().__init__(client, run_id, name)
        self.prompts = list(prompts)
        self.follower = Follower(self.log)
        snap = latest_snapshot(client, run_id)
        if snap is not None:  # a restarted coordinator resumes from the latest snapshot plus the tail after it
            self.follower.start_from(restore(snap), snap.stream_id)
        self.lease = LeaderLease(client, run_id, "coordinator", name, ttl_ms=lease_ttl_ms)
        self.injector = injector or Injector()
        self.decisions = 0
        self.snapshot_every = snapshot_every
        self._snapshot_at = self.follower.state.events_applied  # 0, or the snapshot it started from

    def respawn(self) -> Coordinator:
        """A new coordinator: it rebuilds the state from the log, takes the lease when the old one expires (a larger
        fencing token) and finishes whatever the dead one left open."""
        return Coordinator(
            self.client,
            self.run_id,
            self.next_name(),
            self.prompts,
            lease_ttl_ms=self.lease.ttl_ms,
            injector=self.injector,
        )

    def run(self) -> None:
        renew_at = 0.0
        while not self.stop_event.is_set():
            self.follower.poll(block_ms=50)
            state = self.follower.state
            if state.status in ("completed", "failed", "aborted"):
                break
            if self.lease.token is not None and state.events_applied - self._snapshot_at >= self.snapshot_every:
                take_snapshot(self.client, self.run_id, state, self.follower.last_id)
                self._snapshot_at = state.events_applied
            now = time.time()
            if self.lease.token is None or now >= renew_at:
                if self.lease.acquire() is None:  # takes a free lease or extends ours
                    continue  # another coordinator leads; keep following so we can take over
                renew_at = now + self.lease.ttl_ms / 3000
            fence = self.lease.token
            assert fence is not None
            payloads = decide(state, now, fence, AdmissionInputs(now=now, prompts=self.prompts))
            if not payloads:
                continue
            if self.emitter.emit_if(
                payloads, expected_last_id=self.follower.last_id, policy_version=state.policy_version
            ):
                self.decisions += 1
                if any(isinstance(p, DURABLE_DECISIONS) for p in payloads) and not self.log.wait_durable(
                    timeout_ms=1000
                ):
                    # the decision stands (it is in the log); say that a host crash could still lose it
                    self.logger.warning(
                        "update decision not known durable (AOF off?)", decisions=[p.type for p in payloads]
                    )
                kill = self.injector.peek("kill-worker", worker="coordinator")
                if kill is not None and self.decisions >= kill.after:
                    self.injector.take("kill-worker", worker="coordinator")
                    raise WorkerKilled(f"coordinator killed after {self.decisions} decisions")
        self.lease.release()
