"""Properties of the weight-update transaction, checked on a pure in-memory simulation (no Redis).

The simulation plays every party of a run with the real pure pieces:
- the log is a list of events; every party folds it through `workflows.reducer.fold`;
- the coordinator decides with the real `workflows.update.decide_update` (and `workflows.groups.decide_groups`) on
  the fold of the whole log, as workers/roles/coordinator.py does with its conditional append. It can crash after k
  decisions; its successor holds the next fencing token, waits out the lease TTL and starts from `replay(log)`;
- N simulated ranks react to the log like workers/roles/rank.py's RankWorker, each from its own follower (its own fold,
  which lags the log until the rank reads on): PrepareRequested -> RankPrepared | RankPrepareFailed,
  AdmissionPaused(update) -> stop serving, drained -> EnginePaused, UpdateCommitted -> RankCommitted +
  CacheInvalidated + HealthPassed | HealthFailed, PolicyPublished / UpdateAborted -> resume, RankQuarantined ->
  RankJoined on the newest committed version. Each rank also generates groups: it starts one only while it is
  serving (in its own view), stamped with its live version, and finishes it later stamped with the version live then;
- a trainer stages the next version whenever no update is open; an admission gate admits groups while admission is open.

Hypothesis draws the number of ranks, the failures (rank, phase in prepare|transfer|commit|stale), a coordinator
crash after k decisions, clock jumps past the deadlines, and the interleaving of the parties' steps; after the drawn
prefix every party takes fair turns until the run settles. The properties are listed on `check_properties`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeVar

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rolledger.events.envelope import make_event
from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.schemas.statuses import CacheKind, DrainMode, PreparePhase
from rolledger.schemas.trajectory import Trajectory
from rolledger.workflows.audit import audit
from rolledger.workflows.audit_report import Violation
from rolledger.workflows.groups import decide_groups
from rolledger.workflows.rank import may_serve
from rolledger.workflows.reducer import fold, replay
from rolledger.workflows.state import RunState
from rolledger.workflows.update import about_to_be_quarantined, decide_update

Phase = Literal["prepare", "transfer", "commit", "stale"]
RUN = "sim"
DEADLINE_S = 5.0  # prepare, drain and commit deadlines
JUMP_S = DEADLINE_S + 1.0  # a clock jump passes any deadline that is running
TTL_S = 0.2  # the coordinator lease: a successor decides this long after the crash
STEP_S = 0.01  # clock per drawn step (the drawn prefix alone never reaches a deadline)
ROUND_S = 0.05  # clock per fair round
MAX_DRAWN = 80
MAX_ROUNDS = 800  # (d): the bound within which every transaction must end: 40 s of simulated time, 8 deadlines
N_SAMPLES = 2


def w(v: int) -> str:
    """Weights digest of version v."""
    return f"w{v:04d}"


def m(v: int) -> str:
    return f"m{v:04d}"


def probe(digest: str) -> str:
    """A health probe's output digest: a function of the weights the rank really runs."""
    return f"probe:{digest}"


@dataclass(frozen=True)
class Plan:
    ranks: int
    versions: int  # how many updates the trainer stages, one after the other (numbers 1..versions)
    failures: dict[int, tuple[int, Phase]]  # version -> the rank that fails it, and where
    crash_after: int | None  # the coordinator dies right after its k-th decision
    groups: int  # groups the admission gate admits in all


@dataclass
class SimRank:
    """One rank: the engine's truth, the agent's flags, and the rank's own follower."""

    rank: int
    state: RunState = field(default_factory=RunState)
    cursor: int = 0  # log entries folded into `state`
    version: int = 0  # live weights (the truth the engine runs)
    digest: str = field(default_factory=lambda: w(0))
    staged: int | None = None
    claim: tuple[int, str] | None = None  # stale weights: what the rank claims while running `digest`
    claimed: set[int] = field(default_factory=set)  # versions it claimed without running them
    serving: bool = True
    paused: bool = False
    busy: str | None = None  # group in generation
    busy_stamp: tuple[int, str] = (0, "")
    busy_refused: bool = False  # the engine was paused when the generation began: it fails
    drained_for: int | None = None
    resume_when_closed: bool = False
    cache_gen: int = 0
    history: list[tuple[int, int, str]] = field(default_factory=list)  # (log index, live version, why)

    def stamp(self) -> tuple[int, str]:
        return self.claim if self.claim is not None else (self.version, self.digest)


class Sim:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.cfg = RunConfig.model_validate(
            {
                "ranks": plan.ranks,
                "group_size": N_SAMPLES,
                "steps": 1000,
                "update": {
                    "prepare_deadline_s": DEADLINE_S,
                    "drain_deadline_s": DEADLINE_S,
                    "commit_deadline_s": DEADLINE_S,
                },
            }
        )
        self.log: list[ev.Event] = []
        self.state = RunState()  # the fold of the whole log: what the coordinator decides on
        self.now = 1_000.0
        self.fence = 1
        self.decisions = 0
        self.crashed = False
        self.coordinator_back_at = 0.0
        self.ranks = [SimRank(r) for r in range(plan.ranks)]
        self.taken: set[str] = set()
        self.admitted = 0
        self.problems: list[str] = []  # (a)/(b)/(c) violations observed while running
        self.emit([ev.RunStarted(config=self.cfg, initial_weights_digest=w(0))], "run")
        for r in range(plan.ranks):
            self.emit([ev.RankJoined(rank=r, engine="sim", policy_version=0, weights_digest=w(0))], f"rank-{r}")

    # ------------------------------------------------------------ the log
    def emit(self, payloads: list[ev.Payload], producer: str, version: int | None = None) -> None:
        for p in payloads:
            e = make_event(
                p,
                run_id=RUN,
                producer=producer,
                wall_time=self.now,
                event_id=f"01SIM{len(self.log):021d}",
                policy_version=self.state.policy_version if version is None else version,
            )
            self.log.append(e)
            fold(self.state, e)

    def aborted(self) -> set[int]:
        return {v for v, u in self.state.updates.items() if u.status == "aborted"}

    # ------------------------------------------------------------ coordinator, trainer, admission
    def coordinator(self) -> None:
        if self.now < self.coordinator_back_at:
            return  # the dead leader's lease has not expired yet: nobody decides
        payloads = decide_update(self.state, self.now, self.fence) + decide_groups(self.state, self.now)
        if not payloads:
            return
        self.emit(payloads, f"coordinator#{self.fence}")
        self.decisions += 1
        if self.plan.crash_after == self.decisions and not self.crashed:
            self.crashed = True
            self.fence += 1  # the successor's tenure: a larger token
            self.coordinator_back_at = self.now + TTL_S
            rebuilt = replay(self.log)  # the successor starts from the folded log
            if rebuilt.digest() != self.state.digest():
                self.problems.append("(c) the replayed log differs from the state the dead coordinator decided on")

    def trainer(self) -> None:
        if self.state.open_update is not None or len(self.state.updates) >= self.plan.versions:
            return
        v = max(self.state.updates, default=0) + 1
        self.emit(
            [
                ev.UpdateStaged(
                    version=v,
                    base_version=self.state.policy_version,
                    manifest_digest=m(v),
                    weights_digest=w(v),
                    uri=f"sim://v{v}",
                    bytes=4096,
                    tensors=1,
                )
            ],
            "trainer",
        )

    def admission(self) -> None:
        waiting = [g for g in self.state.groups.values() if g.status == "admitted" and g.group_id not in self.taken]
        if not self.state.admission.open or self.admitted >= self.plan.groups or len(waiting) >= 2:
            return
        self.admitted += 1
        self.emit(
            [
                ev.GroupAdmitted(
                    group_id=f"g{self.admitted:04d}",
                    prompt_id=f"p{self.admitted}",
                    prompt_token_ids=[1, 2, 3],
                    n=N_SAMPLES,
                    sampling=self.cfg.sampling,
                    partial_policy=self.cfg.partial_policy,
                    answer="5",
                    est_remaining_tokens=4,
                    est_bytes=100,
                    queued_bytes=0,
                    byte_cap=self.cfg.admission.max_queued_bytes,
                )
            ],
            "admission",
        )

    # ------------------------------------------------------------ a rank's control thread (workers/roles/rank.py _react)
    def control(self, r: SimRank) -> None:
        if r.cursor < len(self.log):
            e = self.log[r.cursor]
            r.cursor += 1
            fold(r.state, e)
            self.react(r, e)
        self.report_drained(r)

    def react(self, r: SimRank, e: ev.Event) -> None:
        p, s = e.payload, r.state
        if isinstance(p, ev.PrepareRequested) and r.rank in p.ranks:
            self.prepare(r, p)
        elif isinstance(p, ev.AdmissionPaused) and p.reason == "update":
            u = s.open_update
            if u is not None and r.rank in u.ranks:
                r.serving = False
        elif isinstance(p, ev.UpdateCommitted) and r.rank in p.ranks:
            self.commit(r, p)
        elif isinstance(p, ev.PolicyPublished) and (r.rank in p.ranks or r.resume_when_closed):
            self.resume(r)
        elif isinstance(p, ev.UpdateAborted):
            r.staged = None
            mine = s.ranks.get(r.rank)
            if r.rank in p.failed_ranks:
                # quarantined by the same decision (the next event, appended with it in one batch, which a real
                # follower folds in one read): it serves nothing, then rejoins
                r.serving = False
            elif mine is not None and mine.status != "quarantined":
                self.resume(r)
        elif isinstance(p, ev.RankQuarantined) and p.rank == r.rank:
            self.rejoin(r)

    def failure(self, r: SimRank, version: int, phases: tuple[Phase, ...]) -> Phase | None:
        f = self.plan.failures.get(version)
        return f[1] if f is not None and f[0] == r.rank and f[1] in phases else None

    def prepare(self, r: SimRank, p: ev.PrepareRequested) -> None:
        phase = self.failure(r, p.version, ("prepare", "transfer"))
        if phase is not None:
            r.serving = False  # the abort will quarantine it: its rollout starts nothing more (about_to_be_quarantined)
            self.emit(
                [ev.RankPrepareFailed(version=p.version, rank=r.rank, phase=PreparePhase(phase), reason="injected")],
                f"rank-{r.rank}",
                r.version,
            )
            return
        r.staged = p.version
        self.emit(
            [
                ev.RankPrepared(
                    version=p.version, rank=r.rank, manifest_digest=p.manifest_digest, staged_digest=w(p.version)
                )
            ],
            f"rank-{r.rank}",
            r.version,
        )

    def report_drained(self, r: SimRank) -> None:
        s = r.state
        u = s.open_update
        if u is None or u.status != "preparing" or "update" not in s.admission.paused:
            return
        if r.rank not in u.ranks or r.drained_for == u.version or r.busy is not None:
            return
        r.paused = True
        r.drained_for = u.version
        self.emit([ev.EnginePaused(rank=r.rank, mode=DrainMode.WAIT)], f"rank-{r.rank}", r.version)

    def set_live(self, r: SimRank, version: int, why: str) -> None:
        r.version, r.digest = version, w(version)
        r.cache_gen += 1
        r.history.append((len(self.log), version, why))

    def commit(self, r: SimRank, p: ev.UpdateCommitted) -> None:
        v, who = p.version, f"rank-{r.rank}"
        if self.failure(r, v, ("commit",)):
            r.staged = None
            self.emit([ev.HealthFailed(rank=r.rank, version=v, reason="commit failed (injected)")], who, r.version)
            return
        if self.failure(r, v, ("stale",)) or r.claim is not None:  # claims v, keeps serving the old weights
            r.staged, r.claim = None, (v, w(v))
            r.claimed.add(v)
            self.emit(
                [
                    ev.RankCommitted(version=v, rank=r.rank, weights_digest=w(v)),
                    ev.HealthPassed(rank=r.rank, version=v, weights_digest=w(v), probe_digest=probe(r.digest)),
                ],
                who,
                v,
            )
            return
        if r.staged != v:
            self.problems.append(f"(c) rank {r.rank} told to commit v{v}, which it never prepared")
            self.emit([ev.HealthFailed(rank=r.rank, version=v, reason="nothing staged")], who, r.version)
            return
        r.staged = None
        self.set_live(r, v, "commit")
        self.emit(
            [
                ev.RankCommitted(version=v, rank=r.rank, weights_digest=r.digest),
                ev.CacheInvalidated(rank=r.rank, kind=CacheKind.PREFIX, generation=r.cache_gen, version=v),
                ev.HealthPassed(rank=r.rank, version=v, weights_digest=r.digest, probe_digest=probe(r.digest)),
            ],
            who,
            v,
        )

    def resume(self, r: SimRank) -> None:
        if r.paused:
            r.paused = False
            self.emit([ev.EngineResumed(rank=r.rank)], f"rank-{r.rank}", r.version)
        r.drained_for = None
        r.resume_when_closed = False
        r.serving = True

    def rejoin(self, r: SimRank) -> None:
        r.serving, r.claim, r.staged = False, None, None
        s = r.state
        committed = [
            v for v, u in s.updates.items() if u.status in ("committed", "invalidated", "healthy", "published")
        ]
        self.set_live(r, max([*committed, s.policy_version]), "rejoin")
        r.drained_for = None
        self.emit(
            [ev.RankJoined(rank=r.rank, engine="sim", policy_version=r.version, weights_digest=r.digest)],
            f"rank-{r.rank}",
            r.version,
        )
        if s.open_update is not None:
            r.resume_when_closed = True
        else:
            self.resume(r)

    # ------------------------------------------------------------ a rank's rollout thread
    def rollout(self, r: SimRank) -> None:
        who = f"rank-{r.rank}"
        if r.busy is not None:
            gid, (v, digest) = r.busy, r.stamp()
            r.busy = None
            if r.busy_refused:  # the engine refuses to generate while paused: the samples fail
                self.emit(
                    [
                        ev.SampleFailed(sample_id=f"{gid}/{i}", group_id=gid, index=i, rank=r.rank, error="paused")
                        for i in range(N_SAMPLES)
                    ],
                    who,
                    v,
                )
                return
            if (v, digest) != r.busy_stamp:
                self.problems.append(
                    f"(a) group {gid} on rank {r.rank} started on {r.busy_stamp}, finished on {(v, digest)}"
                )
            self.emit(
                [
                    ev.SampleFinished(trajectory=self.trajectory(r, gid, i, v, digest), answer="5")
                    for i in range(N_SAMPLES)
                ],
                who,
                v,
            )
            return
        if not r.serving or not may_serve(r.state, r.rank) or about_to_be_quarantined(r.state, r.rank, self.now):
            return  # (the last two as workers/roles/rollout.py `_may_generate`, on the rank's folded state)
        waiting = [g for g in self.state.groups.values() if g.status == "admitted" and g.group_id not in self.taken]
        if not waiting or waiting[0].group_id not in r.state.groups:
            return  # nothing queued, or the rank's follower has not seen the group yet (the rollout thread waits)
        gid = waiting[0].group_id
        self.taken.add(gid)
        v, digest = r.stamp()
        if v in self.aborted():
            self.problems.append(f"(a) rank {r.rank} starts {gid} on v{v}, which was aborted")
        r.busy, r.busy_stamp, r.busy_refused = gid, (v, digest), r.paused
        self.emit(
            [
                ev.SampleStarted(
                    sample_id=f"{gid}/{i}", group_id=gid, index=i, rank=r.rank, policy_version=v, weights_digest=digest
                )
                for i in range(N_SAMPLES)
            ],
            who,
            v,
        )

    def trajectory(self, r: SimRank, gid: str, i: int, v: int, digest: str) -> Trajectory:
        return Trajectory(
            trajectory_id=f"{gid}/{i}",
            group_id=gid,
            prompt_id="p",
            index=i,
            prompt_token_ids=[1, 2, 3],
            token_ids=[7, 8],
            loss_mask=[1, 1],
            positions=[3, 4],
            logprobs=[-0.5, -0.25],
            logprob_mode="raw",
            finish_reason="stop",
            sampling=self.cfg.sampling,
            policy_version=v,
            weights_digest=digest,
            rank=r.rank,
            engine="sim",
            cache_generation=r.cache_gen,
            graph_generation=0,
        )

    # ------------------------------------------------------------ scheduling
    @property
    def parties(self) -> list[tuple[str, int]]:
        return [("coordinator", -1), ("trainer", -1), ("admission", -1)] + [
            (kind, r) for r in range(self.plan.ranks) for kind in ("control", "rollout")
        ]

    def act(self, party: tuple[str, int]) -> None:
        kind, r = party
        if kind == "coordinator":
            self.coordinator()
        elif kind == "trainer":
            self.trainer()
        elif kind == "admission":
            self.admission()
        elif kind == "control":
            self.control(self.ranks[r])
        else:
            self.rollout(self.ranks[r])

    def settled(self) -> bool:
        s = self.state
        return (
            len(s.updates) == self.plan.versions
            and s.open_update is None
            and "update" not in s.admission.paused
            and all(r.cursor == len(self.log) and r.busy is None and r.serving for r in self.ranks)
            and all(rs.status != "quarantined" for rs in s.ranks.values())
            and not decide_update(s, self.now, self.fence)
        )

    def run(self, schedule: list[int], jumps: set[int]) -> int:
        """The drawn prefix, then fair rounds until settled; returns the number of fair rounds it took."""
        parties = self.parties
        for i, pick in enumerate(schedule):
            self.now += JUMP_S if i in jumps else STEP_S
            self.act(parties[pick % len(parties)])
        for rounds in range(MAX_ROUNDS):
            if self.settled():
                return rounds
            self.now += ROUND_S
            for party in parties:
                self.act(party)
        return MAX_ROUNDS


# ---------------------------------------------------------------- the properties
P = TypeVar("P", bound=ev.Payload)


def of(log: list[ev.Event], cls: type[P]) -> list[tuple[int, P]]:
    """(log index, payload) of every event of type `cls`."""
    return [(i, e.payload) for i, e in enumerate(log) if isinstance(e.payload, cls)]


def check_properties(sim: Sim, rounds: int) -> None:
    """(a) no group is generated with two versions, no rank serves an aborted version, no rank generates after it
        reported EnginePaused;
    (b) every UpdateAborted leaves every rank's live version unchanged;
    (c) a logged decision is never lost or contradicted: no version both committed and aborted, none decided twice,
        every committed version is published on every committed rank that was not quarantined, which runs it;
    (d) every transaction ends (published or aborted) within MAX_ROUNDS fair rounds, with every rank back in service
        on the published version;
    (e) the audit finds no violation of invariants 2-4 and the reducer no anomaly.
    Stale weights the probe cannot name (fewer than three ranks in the update: one probe, or a tie) are a documented
    gap; such a rank never invalidated its cache for the version it claims, so the audit must show it instead."""
    log, state = sim.log, sim.state
    assert not sim.problems, sim.problems
    # (d) termination, and the settled end state
    assert rounds < MAX_ROUNDS, (
        f"not settled after {MAX_ROUNDS} fair rounds: updates {[(v, u.status) for v, u in state.updates.items()]}, "
        f"paused {state.admission.paused}, ranks {[(r.rank, r.status) for r in state.ranks.values()]}"
    )
    stale = {r.rank for r in sim.ranks if r.claim is not None}
    for r in sim.ranks:
        if r.rank not in stale:
            assert (r.version, r.digest) == (state.policy_version, w(state.policy_version)), (
                f"rank {r.rank} runs v{r.version}/{r.digest}"
            )
    # (c) decisions
    commits = [p.version for _, p in of(log, ev.UpdateCommitted)]
    aborts = [p.version for _, p in of(log, ev.UpdateAborted)]
    publishes = [p for _, p in of(log, ev.PolicyPublished)]
    published = {p.version: p for p in publishes}
    assert len(set(commits)) == len(commits) and len(set(aborts)) == len(aborts), (commits, aborts)
    assert len(published) == len(publishes), [p.version for p in publishes]
    assert not set(commits) & set(aborts), (commits, aborts)
    assert sorted(commits) == sorted(published) and sorted(set(commits) | set(aborts)) == list(
        range(1, sim.plan.versions + 1)
    )
    for v, u in state.updates.items():
        assert u.status == ("published" if v in commits else "aborted"), (v, u.status)
    published_stale: set[tuple[int, int]] = set()  # (version, rank): published on a rank that only claimed it
    for _, c in of(log, ev.UpdateCommitted):
        quarantined = {q.rank for _, q in of(log, ev.RankQuarantined) if q.version == c.version}
        pub = published[c.version]
        assert set(pub.ranks) == set(c.ranks) - quarantined, (c.version, pub.ranks, c.ranks, quarantined)
        for rank in pub.ranks:
            swapped = any(ver == c.version and why == "commit" for _, ver, why in sim.ranks[rank].history)
            assert swapped or c.version in sim.ranks[rank].claimed, (
                f"v{c.version} published on rank {rank}, which never swapped to it"
            )
            if not swapped:
                published_stale.add((c.version, rank))
    # (a)/(b) aborted versions were never live anywhere, and nothing swapped while their transaction was open
    for j, a in of(log, ev.UpdateAborted):
        asked = next((i for i, p in of(log, ev.PrepareRequested) if p.version == a.version), j)
        for r in sim.ranks:
            assert all(ver != a.version for _, ver, _ in r.history), f"rank {r.rank} went live on aborted v{a.version}"
            assert not [h for h in r.history if asked < h[0] <= j and h[2] == "commit"], (
                f"rank {r.rank} swapped during aborted v{a.version}"
            )
    # (a) the drain: no rank starts a group after it reported EnginePaused
    assert not drain_violations(log), drain_violations(log)
    # (e) audit and reducer
    report = audit(log)

    def names_stale(x: Violation, v: int, rank: int) -> bool:
        """The audit names the stale publication: the rank never invalidated its cache for v, or its probe (which
        covers the exact logits of the weights it really runs) disagrees with the other ranks'."""
        if x.invariant != 4:
            return False
        never_invalidated = f"v{v} published but rank {rank} never invalidated" in x.message
        probes_disagree = f"v{v} published while the ranks' health probes disagree" in x.message
        return never_invalidated or (probes_disagree and f"rank {rank}: " in x.message)

    for v, rank in published_stale:
        assert any(names_stale(x, v, rank) for x in report.violations), report.render()
    bad = [
        x
        for x in report.violations
        if x.invariant in (2, 3, 4) and not any(names_stale(x, v, rank) for v, rank in published_stale)
    ]
    assert not bad, report.render()
    assert state.anomalies == [], state.anomalies


def drain_violations(log: list[ev.Event]) -> list[str]:
    """SampleStarted on a rank between its EnginePaused and its EngineResumed: it said it drained, then generated."""
    out: list[str] = []
    drained: set[int] = set()
    for e in log:
        p = e.payload
        if isinstance(p, ev.EnginePaused):
            drained.add(p.rank)
        elif isinstance(p, ev.EngineResumed):
            drained.discard(p.rank)
        elif isinstance(p, ev.SampleStarted) and p.rank in drained:
            out.append(f"{p.sample_id} started on rank {p.rank} after it reported EnginePaused ({e.event_id})")
    return out


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    n = draw(st.integers(1, 4))
    versions = draw(st.integers(1, 3))
    phases: list[Phase] = ["prepare", "transfer", "commit", "stale"]
    failures: dict[int, tuple[int, Phase]] = {}
    for v in range(1, versions + 1):
        if draw(st.booleans()):
            failures[v] = (draw(st.integers(0, n - 1)), draw(st.sampled_from(phases)))
    crash_after = draw(st.none() | st.integers(1, 10))
    return Plan(n, versions, failures, crash_after, draw(st.integers(0, 5)))


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@example(
    plan=Plan(1, 1, {1: (0, "commit")}, None, 0), schedule=[], jumps=set()
)  # every rank quarantined: the update must still end
@example(
    plan=Plan(2, 2, {1: (0, "commit")}, None, 0), schedule=[], jumps=set()
)  # a rank rejoined behind, and an update staged under the previous pause
@example(
    plan=Plan(2, 1, {}, None, 1), schedule=[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 30, 0, 0], jumps={14}
)  # a rank starts a group before it folds its quarantine for an aborted update: on untouched weights, benign
@example(
    plan=Plan(2, 2, {1: (0, "prepare")}, None, 5), schedule=[1], jumps=set()
)  # rank 0 rejoins on v0 during v2's update without it; after v2 publishes, its rollout may not start a group on the
# v0 it still holds (may_serve: behind the published), before or after it folds its quarantine for being behind
@given(
    plan=plans(),
    schedule=st.lists(st.integers(0, 63), max_size=MAX_DRAWN),
    jumps=st.sets(st.integers(0, MAX_DRAWN - 1), max_size=2),
)
def test_simulated_the_transaction_is_fail_closed_under_failures_crashes_and_clock_jumps(
    plan: Plan, schedule: list[int], jumps: set[int]
) -> None:
    sim = Sim(plan)
    rounds = sim.run(schedule, jumps)
    check_properties(sim, rounds)


# ---------------------------------------------------------------- pinned cases (each a bug or a documented gap)
def settle(plan: Plan, schedule: list[int] | None = None, jumps: set[int] | None = None) -> tuple[Sim, int]:
    sim = Sim(plan)
    return sim, sim.run(schedule or [], jumps or set())


def test_simulated_a_committed_update_whose_every_rank_was_quarantined_still_ends() -> None:
    sim, rounds = settle(Plan(1, 1, {1: (0, "commit")}, None, 0))  # the only rank fails its swap
    assert rounds < MAX_ROUNDS and sim.state.updates[1].status == "published"
    assert "update" not in sim.state.admission.paused  # the run goes on: the trainer may stage the next version


def test_simulated_a_rank_rejoined_on_an_older_version_is_brought_to_the_published_one() -> None:
    # rank 0 fails its v1 swap, is quarantined and rejoins on v1 after v2 asked only rank 1 to prepare
    sim, rounds = settle(Plan(2, 2, {1: (0, "commit")}, None, 0))
    assert rounds < MAX_ROUNDS and sim.state.policy_version == 2
    assert [(r.rank, r.version) for r in sim.ranks] == [(0, 2), (1, 2)]


def test_simulated_every_update_drains_under_its_own_pause() -> None:
    # the trainer stages v2 in the same round that v1 is published, before the coordinator reopens admission
    sim, rounds = settle(Plan(2, 2, {}, None, 0))
    assert rounds < MAX_ROUNDS and sorted(sim.state.updates) == [1, 2]
    # each transaction's drain starts at its own AdmissionPaused (its drain deadline counts from there, and its ranks
    # stop serving on it); under a pause left over from v1, v2's ranks report EnginePaused while still serving
    assert all(u.paused_at > 0 for u in sim.state.updates.values()), [
        (v, u.paused_at) for v, u in sim.state.updates.items()
    ]


def test_simulated_a_group_started_before_the_rank_read_the_pause_is_drained_before_the_commit() -> None:
    # rank 0 starts the queued group after AdmissionPaused(update) is in the log, before its follower read it
    sim, rounds = settle(Plan(1, 1, {}, None, 1), [1])
    log = sim.log
    paused = next(i for i, _ in of(log, ev.AdmissionPaused))
    started = next(i for i, _ in of(log, ev.SampleStarted))
    finished = max(i for i, _ in of(log, ev.SampleFinished))
    committed = next(i for i, _ in of(log, ev.UpdateCommitted))
    assert paused < started < finished < committed  # the start is late, but the swap waits for it
    assert not sim.problems and rounds < MAX_ROUNDS
    assert {p.trajectory.policy_version for _, p in of(log, ev.SampleFinished)} == {0}
    assert not audit(log).for_invariant(2)  # a drained start is legal: generation stops per rank at its EnginePaused


def test_simulated_stale_weights_on_two_ranks_tie_the_probe_but_the_audit_shows_them() -> None:
    sim, rounds = settle(Plan(2, 1, {1: (1, "stale")}, None, 0))
    assert rounds < MAX_ROUNDS and sim.ranks[1].claim == (1, w(1)) and sim.ranks[1].digest == w(0)
    assert not [e for _, e in of(sim.log, ev.RankQuarantined)]  # a tie names nobody
    report = audit(sim.log)
    assert any(x.invariant == 4 and "rank 1 never invalidated" in x.message for x in report.violations), report.render()


def test_simulated_a_coordinator_crash_mid_transaction_aborts_at_the_deadline_and_the_next_version_commits() -> None:
    # the coordinator dies right after PrepareRequested (its 1st decision); its successor never commits v1
    sim, rounds = settle(Plan(2, 2, {}, 1, 0))
    assert rounds < MAX_ROUNDS
    aborted = [(i, p) for i, p in of(sim.log, ev.UpdateAborted)]
    assert [(p.version, p.fence) for _, p in aborted] == [(1, 2)]
    assert sim.log[aborted[0][0]].wall_time > sim.state.updates[1].deadline  # at the deadline, not before
    assert not [p for _, p in of(sim.log, ev.UpdateCommitted) if p.version == 1]
    assert sim.state.updates[2].status == "published" and sim.state.updates[2].fence == 2
