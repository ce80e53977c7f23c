"""The checks after a chaos schedule, as pure functions of what the harness collected: the decoded log (with its
stream ids), the ids each process saw acknowledged, and how the processes ended. No Redis, no processes: the unit
tests in test_chaos.py feed these hand-made logs.

A schedule passes when: the run finished (`RunFinished` completed) or failed closed (`RunFinished` failed/aborted
naming a reason), exactly once; `workflows.audit.audit` is clean; every acknowledged event id is in the log (else it
counts as *lost*); a failed run did not just stall until its run deadline; no event id twice in the log; no trajectory or group consumed twice (`BatchConsumed`); no anomaly in the folded
state (an impossible transition: e.g. a late result for a sample another rank already finished); every
in-service rank ends on the published version (by the folded state and by its own last `RankJoined`/`RankCommitted`);
every process exited by itself within the deadline after the run ended; every process's ack hook was installed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import RunStatus
from rolledger.workflows.audit import audit
from rolledger.workflows.reducer import replay


class Ending(StrEnum):
    FINISHED = "finished"  # RunFinished completed
    FAILED_CLOSED = "failed-closed"  # RunFinished failed/aborted, naming the reason
    NOT_ENDED = "not-ended"  # no RunFinished: a hang (always a violation)


@dataclass(frozen=True)
class Ack:
    """One line of an ack log: an event id a process saw acknowledged."""

    event_id: str
    stream_id: str
    type: str
    process: str


@dataclass
class Verdict:
    ending: Ending
    reason: str = ""
    violations: list[str] = field(default_factory=list)
    lost: list[Ack] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.lost


def parse_ack_log(text: str, process: str) -> tuple[bool, list[Ack]]:
    """(whether the hook's header line is there, the acks) of one process incarnation's ack file."""
    header = False
    acks: list[Ack] = []
    for line in text.splitlines():
        if line.startswith("# hook "):
            header = True
            continue
        parts = line.split()
        if len(parts) >= 3:
            acks.append(Ack(parts[0], parts[1], parts[2], process))
    return header, acks


def ending_of(events: Sequence[ev.Event]) -> tuple[Ending, str, list[str]]:
    finished = [e for e in events if isinstance(e.payload, ev.RunFinished)]
    problems: list[str] = []
    if not finished:
        return Ending.NOT_ENDED, "", ["the run neither finished nor failed closed (no RunFinished)"]
    if len(finished) > 1:
        problems.append(f"RunFinished {len(finished)} times: " + ", ".join(e.event_id for e in finished))
    first = finished[0].payload
    assert isinstance(first, ev.RunFinished)
    if first.status == RunStatus.COMPLETED:
        return Ending.FINISHED, first.reason, problems
    if not first.reason.strip():
        problems.append(f"RunFinished({first.status}) names no reason ({finished[0].event_id})")
    return Ending.FAILED_CLOSED, first.reason, problems


def stalled(events: Sequence[ev.Event]) -> list[str]:
    """A run that ended only because its run deadline passed did not fail closed, it wedged: the schedules' runs take
    seconds and their deadline is a minute. (The join deadline is set to the same value and counts the same.)"""
    started = next((e for e in events if isinstance(e.payload, ev.RunStarted)), None)
    finished = next((e for e in events if isinstance(e.payload, ev.RunFinished)), None)
    if started is None or finished is None or not isinstance(started.payload, ev.RunStarted):
        return []
    assert isinstance(finished.payload, ev.RunFinished)
    if finished.payload.status == RunStatus.COMPLETED:
        return []
    took = finished.wall_time - started.wall_time
    limit = min(started.payload.config.run_deadline_s, started.payload.config.join_deadline_s)
    if took >= limit:
        return [
            f"the run stalled until its deadline ({took:.0f} s >= {limit:g} s): RunFinished({finished.payload.reason})"
        ]
    return []


def served_versions(events: Sequence[ev.Event]) -> list[str]:
    """Every in-service rank must end on the published version: by the folded state and by what the rank itself
    last announced (RankJoined / RankCommitted after its last RankQuarantined)."""
    problems: list[str] = []
    state = replay(events)
    # A failed run may end after a commit was decided and before it was published; the decision stands, so a rank
    # on that committed version is not serving a wrong one.
    allowed = {state.policy_version}
    if RunStatus(state.status) is not RunStatus.COMPLETED:
        allowed |= {v for v, u in state.updates.items() if u.status.is_decided_commit}
    waiting = _waiting_for_reload(events, state.policy_version)
    for r, rank in sorted(state.ranks.items()):
        if not rank.status.in_service:
            continue
        if rank.committed_version not in allowed and r not in waiting:
            problems.append(
                f"rank {r} ends on v{rank.committed_version}, the published version is v{state.policy_version}"
            )
        elif (
            rank.committed_version == state.policy_version
            and rank.weights_digest
            and state.weights_digest
            and rank.weights_digest != state.weights_digest
        ):
            problems.append(f"rank {r} ends with weights {rank.weights_digest[:12]}, published ones differ")
    said: dict[int, tuple[int, str]] = {}
    for e in events:
        p = e.payload
        if isinstance(p, ev.RankJoined):
            said[p.rank] = (p.policy_version, e.event_id)
        elif isinstance(p, ev.RankCommitted):
            said[p.rank] = (p.version, e.event_id)
        elif isinstance(p, ev.RankQuarantined):
            said.pop(p.rank, None)
    for r, (version, eid) in sorted(said.items()):
        rank_state = state.ranks.get(r)
        if rank_state is not None and not rank_state.status.in_service:
            continue
        if version not in allowed and r not in waiting:
            problems.append(
                f"rank {r} last announced v{version} ({eid}); the published version is v{state.policy_version}"
            )
    return problems


def _waiting_for_reload(events: Sequence[ev.Event], published: int) -> set[int]:
    """The ranks that rejoined on the version published at the time, saw a newer one published by an update they
    were not part of, and had not reloaded it when the run ended. The rank decider holds such a rank's generation
    until the coordinator's Reload lands (workflows/rank.py), so it served nothing stale. A rank that joined on a
    version older than the one published when it joined, or started a sample on old weights after the newer
    version was published, is not waiting: it is a violation."""
    current = -1  # the version published so far, as the log is read
    published_at = -1
    waiting: set[int] = set()
    for i, e in enumerate(events):
        p = e.payload
        if isinstance(p, ev.PolicyPublished):
            current = max(current, p.version)
            if p.version == published:
                published_at = i
        elif isinstance(p, ev.RankJoined) and p.policy_version >= current:
            waiting.add(p.rank)
        elif isinstance(p, ev.RankJoined | ev.RankCommitted):  # joined behind, or reloaded: not waiting
            waiting.discard(p.rank)
        elif isinstance(p, ev.SampleStarted) and p.policy_version < published and 0 <= published_at < i:
            waiting.discard(p.rank)  # it served old weights after the newer version was published
    return waiting if published_at >= 0 else set()


def trained_twice(events: Iterable[ev.Event]) -> list[str]:
    trajectories: Counter[str] = Counter()
    groups: Counter[str] = Counter()
    for e in events:
        if isinstance(e.payload, ev.BatchConsumed):
            trajectories.update(e.payload.trajectory_ids)
            groups.update(e.payload.group_ids)
    out = [f"trajectory {t} trained {n} times" for t, n in sorted(trajectories.items()) if n > 1]
    out += [f"group {g} consumed {n} times" for g, n in sorted(groups.items()) if n > 1]
    return out


def judge(
    events: Sequence[ev.Event],
    acks: Sequence[Ack],
    *,
    hooks_missing: Sequence[str] = (),
    hung: Sequence[str] = (),
    undecodable: int = 0,
    deadline_is_violation: bool = True,
) -> Verdict:
    """Every check of a finished schedule. `hooks_missing`: process incarnations whose ack hook did not load;
    `hung`: processes that did not exit by themselves in time after the run ended; `undecodable`: log entries that
    did not decode; `deadline_is_violation`: a run ended by its run deadline wedged (False: it failed closed)."""
    ending, reason, violations = ending_of(events)
    verdict = Verdict(ending, reason, violations)
    if deadline_is_violation:
        verdict.violations += stalled(events)
    if hooks_missing:
        verdict.violations.append("harness: the ack hook did not load in " + ", ".join(hooks_missing))
    if undecodable:
        verdict.violations.append(f"{undecodable} log entries do not decode")
    report = audit(events)
    for v in report.violations:
        verdict.violations.append(f"audit: invariant {v.invariant}: {v.message}"[:300])
    counts = Counter(e.event_id for e in events)
    verdict.violations += [f"event {i} is in the log {n} times" for i, n in sorted(counts.items()) if n > 1]
    verdict.violations += trained_twice(events)
    verdict.violations += served_versions(events)
    verdict.violations += [
        f"reducer anomaly at {a.event_id} ({a.event_type}): {a.message}"[:300] for a in replay(events).anomalies
    ]
    verdict.violations += [f"process {p} did not exit after the run ended" for p in hung]
    in_log = set(counts)
    seen: set[str] = set()
    for a in acks:
        if a.event_id not in in_log and a.event_id not in seen:
            seen.add(a.event_id)
            verdict.lost.append(a)
    return verdict


def summary_line(schedules: int, faults: int, finished: int, failed_closed: int, violations: int, lost: int) -> str:
    return (
        f"schedules {schedules}, faults injected {faults}, runs finished {finished}, runs failed-closed "
        f"{failed_closed}, violations {violations}, events lost {lost}"
    )


def count_by_process(acks: Iterable[Ack]) -> Mapping[str, int]:
    return Counter(a.process for a in acks)
