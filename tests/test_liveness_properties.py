"""Liveness of a run, checked on a pure in-memory simulation (no Redis): it always ends, and says why.

The simulated world plays every party with the real pure pieces, folding one log through `workflows.reducer.fold`:
the coordinator decides with `workflows.coordinator.decide` (terminal, updates, groups, run end, admission), each rank
with `workflows.rank.decide_rank` (its actions played into events by the engine simulation of
tests/test_rank_decider.py), the trainer with `workflows.trainer.plan_step`, and a reward worker scores every
finished sample. Hypothesis draws the ranks, prepare / transfer / commit failures per (rank, version), ranks that die
(stop answering: no turns, their groups stay pending) and come back (a fresh engine; its restarted rollout closes
what it left), a rank's groups reclaimed by a live rank once `recovery.lost_after_s` passed without a beat, trainer
delays (the trainer simply gets no turn), clock jumps past every deadline, and the interleaving of all of it. After
the drawn prefix every live party takes fair turns, one simulated second per round; rank 0 is always brought back.

Checked: within a bounded number of rounds the run reaches RunFinished; `completed`, or `failed` with a reason that
names the cause (updates aborted in a row, with each version and why; no rank in service; ranks that never
joined); never a wait for the run
deadline, and never a stretch of rounds longer than the longest deadline in which nothing at all is decided while
the run is RUNNING. No anomaly in the reducer either. The pinned cases below are the issue's: two aborts in a row with
max_lag=1 (a hang before: the lag gate counted against the published version), a dead rank (each update aborted
before: it was never taken out of service), and the terminals.
"""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from logbuilder import LogBuilder
from test_rank_decider import Sim as RankSim

from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.schemas.statuses import EngineStatus, RunStatus, SampleStatus, UpdateStatus
from rolledger.schemas.trajectory import Trajectory
from rolledger.workflows.admission import AdmissionInputs, gates
from rolledger.workflows.coordinator import decide
from rolledger.workflows.reducer import replay
from rolledger.workflows.scheduler import PromptItem
from rolledger.workflows.trainer import TrainPlan, plan_step
from rolledger.workflows.update import about_to_be_quarantined, decide_update

DEADLINE_S = 10.0  # prepare, drain, commit
LOST_AFTER_S = 10.0
NO_RANK_S = 30.0
LONGEST_S = NO_RANK_S + DEADLINE_S + 5.0  # no deadline of the run is longer: a quiet stretch beyond it is a wedge
MAX_ROUNDS = 1500  # fair rounds of one simulated second each
PROMPTS = [PromptItem(i, f"p{i}", (1, 2, 3), "5") for i in range(16)]


def config(ranks: int, **overrides: object) -> RunConfig:
    data: dict[str, object] = {
        "ranks": ranks,
        "steps": 4,
        "group_size": 2,
        "trainer": {"groups_per_step": 2},
        "admission": {"max_lag": 1, "max_inflight_groups": 4},
        "update": {
            "prepare_deadline_s": DEADLINE_S,
            "drain_deadline_s": DEADLINE_S,
            "commit_deadline_s": DEADLINE_S,
        },
        "recovery": {"heartbeat_s": 1.0, "lost_after_s": LOST_AFTER_S, "no_rank_in_service_s": NO_RANK_S},
        "run_deadline_s": 1e6,  # the run must end by its own mechanisms, never by this
        "join_deadline_s": NO_RANK_S,
    }
    data.update(overrides)
    return RunConfig.model_validate(data)


class World(RankSim):
    """The rank decider's simulation, with the whole coordinator, the trainer's planner, rewards and dying ranks."""

    def __init__(self, ranks: int, cfg: RunConfig, failures: dict[tuple[int, int], str]) -> None:
        super().__init__(ranks, cfg, failures)
        self.dead: dict[int, float] = {}  # rank -> when it stopped answering
        self.reclaimable: set[str] = set()  # groups whose rank died: pending entries nobody beats for

    # ------------------------------------------------------------ parties
    def coordinator(self) -> None:
        self.emit(*decide(self.state, self.now, 1, AdmissionInputs(now=self.now, prompts=PROMPTS)))

    def trainer(self) -> None:
        plan = plan_step(self.state)
        if not isinstance(plan, TrainPlan):
            return
        self.emit(*plan.drops)
        if plan.batch is None:
            return
        self.emit(
            plan.batch,
            ev.TrainStepFinished(
                step=plan.step,
                loss=0.0,
                reward_mean=1.0,
                logprob_gap_median=0.0,
                logprob_gap_p99=0.0,
                max_seq_ratio=1.0,
                clipped_frac=0.0,
            ),
            ev.UpdateStaged(
                version=plan.version,
                base_version=plan.base_version,
                manifest_digest=f"m{plan.version:04d}",
                weights_digest=f"w{plan.version:04d}",
                uri=f"file:///staging/v{plan.version:06d}",
                bytes=10,
                tensors=1,
            ),
        )

    def reward(self) -> None:
        for g in list(self.state.groups.values()):
            for s in list(g.samples.values()):
                if s.status == SampleStatus.FINISHED and s.reward is None:
                    self.emit(ev.SampleScored(sample_id=s.sample_id, group_id=g.group_id, reward=1.0, correct=True))

    def finish(self, r: int) -> None:
        """The rank's running group ends: each running sample finishes, or is cancelled if the group was closed."""
        if r in self.dead or not self.engines[r].running:
            return
        gid = self.engines[r].running.pop(0)
        g = self.state.groups[gid]
        for i, s in sorted(g.samples.items()):
            if s.status != SampleStatus.STARTED:
                continue
            if not g.status.is_open:
                self.emit(ev.SampleCancelled(sample_id=s.sample_id, group_id=gid, index=i, reason="group closed"))
                continue
            t = Trajectory(
                trajectory_id=s.sample_id,
                group_id=gid,
                prompt_id=g.prompt_id,
                index=i,
                prompt_token_ids=[1, 2, 3],
                token_ids=[7, 8],
                loss_mask=[1, 1],
                positions=[3, 4],
                logprobs=[-0.5, -0.25],
                logprob_mode="raw",
                finish_reason="stop",
                sampling=self.cfg.sampling,
                policy_version=s.policy_version,
                weights_digest=s.weights_digest,
                rank=r,
                engine="sim",
                cache_generation=0,
                graph_generation=0,
            )
            self.emit(ev.SampleFinished(trajectory=t, answer="5"))

    def start(self, r: int) -> None:
        if r in self.dead or about_to_be_quarantined(self.state, r, self.now):
            return  # (as workers/roles/rollout.py: a rank the open update will quarantine starts nothing)
        super().start(r)

    def rank_turn(self, r: int) -> None:
        if r not in self.dead:
            super().rank_turn(r)

    def die(self, r: int) -> None:
        if r not in self.dead:
            self.dead[r] = self.now
            self.reclaimable.update(self.engines[r].running)

    def revive(self, r: int) -> None:
        """A fresh engine on the initial weights; the restarted rollout closes what its predecessor left running."""
        if r not in self.dead:
            return
        del self.dead[r]
        me = self.state.ranks.get(r)
        if me is not None and me.status == EngineStatus.ASLEEP:
            self.dead[r] = self.now  # (not modelled: a restarted engine awake while the log says it sleeps)
            return
        for gid in self.engines[r].running:
            self._close_orphans(gid, r)
            self.reclaimable.discard(gid)
        self.engines[r] = type(self.engines[r])()

    def reclaim(self) -> None:
        """A live rank takes over a dead rank's pending groups once their beats are LOST_AFTER_S overdue."""
        live = [r for r in range(self.ranks) if r not in self.dead]
        if not live:
            return
        for r, since in list(self.dead.items()):
            if self.now <= since + LOST_AFTER_S:
                continue
            for gid in list(self.engines[r].running):
                self.engines[r].running.remove(gid)
                self.reclaimable.discard(gid)
                self._close_orphans(gid, live[0])

    def _close_orphans(self, gid: str, by: int) -> None:
        g = self.state.groups[gid]
        self.emit(
            *[
                ev.SampleFailed(sample_id=s.sample_id, group_id=gid, index=i, rank=by, error="worker lost")
                for i, s in sorted(g.samples.items())
                if s.status == SampleStatus.STARTED
            ]
        )

    def move(self, kind: str, r: int) -> None:
        r %= self.ranks
        {
            "coordinator": self.coordinator,
            "rank": lambda: self.rank_turn(r),
            "start": lambda: self.start(r),
            "finish": lambda: self.finish(r),
            "trainer": self.trainer,
            "reward": self.reward,
            "tick": lambda: setattr(self, "now", self.now + DEADLINE_S + 1.0),
            "die": lambda: self.die(r),
            "revive": lambda: self.revive(r),
            "reclaim": self.reclaim,
        }[kind]()

    def fair_round(self) -> None:
        for r in range(self.ranks):
            self.finish(r)
            self.rank_turn(r)
            self.start(r)
        self.reward()
        self.coordinator()
        self.trainer()
        self.reclaim()
        self.now += 1.0


MOVES = ["coordinator"] * 3 + ["rank"] * 3 + ["start"] * 2 + ["finish"] * 2 + ["trainer", "reward", "tick"]
MOVES += ["die", "revive", "reclaim"]

Scenario = tuple[int, dict[tuple[int, int], str], list[tuple[str, int]], set[int]]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    ranks = draw(st.integers(1, 3))
    failures = draw(
        st.dictionaries(
            st.tuples(st.integers(0, ranks - 1), st.integers(1, 8)),
            st.sampled_from(["prepare", "prepare", "commit"]),  # prepare: a failed read or transfer
            max_size=5,
        )
    )
    moves = draw(st.lists(st.tuples(st.sampled_from(MOVES), st.integers(0, 2)), max_size=120))
    forever = draw(st.sets(st.integers(1, 2), max_size=1))  # ranks that stay dead (rank 0 always comes back)
    return ranks, failures, moves, forever


def run_to_the_end(world: World, moves: list[tuple[str, int]], forever: set[int]) -> int:
    """Play the drawn prefix, then fair rounds until RunFinished; the number of fair rounds it took."""
    for kind, r in moves:
        world.move(kind, r)
    for r in list(world.dead):
        if r not in forever:
            world.revive(r)
    quiet_since, seen = world.now, len(world.log)
    for rounds in range(MAX_ROUNDS):
        if world.state.status != RunStatus.RUNNING:
            return rounds
        world.fair_round()
        if len(world.log) != seen:
            quiet_since, seen = world.now, len(world.log)
        assert world.now - quiet_since <= LONGEST_S, wedge_report(world)
    raise AssertionError(f"no RunFinished within {MAX_ROUNDS} rounds\n{wedge_report(world)}")


def wedge_report(world: World) -> str:
    s = world.state
    updates = {v: (u.status, u.abort_reason) for v, u in s.updates.items()}
    ranks = {r.rank: r.status for r in s.ranks.values()}
    groups = {g.group_id: g.status for g in s.groups.values() if g.untrained}
    return (
        f"step {s.trainer.step}, v{s.policy_version}, paused {s.admission.paused}, updates {updates}, "
        f"ranks {ranks}, dead {sorted(world.dead)}, untrained groups {groups}, plan {plan_step(s)}"
    )


def check_end(world: World) -> None:
    s = world.state
    assert s.anomalies == [], s.anomalies
    end = [e.payload for e in world.log if isinstance(e.payload, ev.RunFinished)]
    assert len(end) == 1, end
    fin = end[0]
    if fin.status == RunStatus.COMPLETED:
        assert s.trainer.step == world.cfg.steps
        return
    assert fin.status == RunStatus.FAILED, fin
    assert "run deadline" not in fin.reason
    if "aborted in a row" in fin.reason:
        aborted = [u for u in s.updates.values() if u.status == UpdateStatus.ABORTED]
        assert len(aborted) >= world.cfg.update.max_consecutive_aborts
        for u in aborted[-world.cfg.update.max_consecutive_aborts :]:
            assert f"v{u.version}: {u.abort_reason}" in fin.reason  # each version and why
    elif "did not join" in fin.reason:
        # the ranks named are exactly those the log never saw join (dead ones, or live ones whose turn never came
        # before the clock passed the join deadline)
        missing = [r for r in range(world.ranks) if r not in s.ranks]
        assert missing and fin.reason == f"ranks {missing} did not join within {NO_RANK_S:g} s", fin.reason
    else:
        assert "no rank in service" in fin.reason, fin.reason
        assert not any(r.status.in_service for r in s.ranks.values())
    assert replay(world.log).digest() == s.digest()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@example(scenario=(2, {(1, 1): "prepare", (1, 2): "prepare"}, [], set()))  # the two aborts in a row
@example(scenario=(2, {}, [("rank", 0), ("rank", 1), ("die", 1)], {1}))  # a rank dead for good
@example(scenario=(2, {}, [("die", 1)], {1}))  # a rank that never joined
@example(scenario=(1, {}, [("tick", 0), ("tick", 0), ("tick", 0), ("coordinator", 0)], set()))  # a live rank too late
@example(scenario=(1, {(0, 1): "prepare", (0, 2): "prepare", (0, 3): "prepare"}, [], set()))  # three in a row
@given(scenarios())
def test_every_run_ends_and_names_why(scenario: Scenario) -> None:
    ranks, failures, moves, forever = scenario
    world = World(ranks, config(ranks), failures)
    run_to_the_end(world, moves, forever)
    check_end(world)


# ---------------------------------------------------------------- pinned: the gates and the terminals, one by one
def aborted_twice() -> World:
    """max_lag=1, v1 and v2 aborted by rank 1's failed prepares, everything the trainer trained consumed."""
    world = World(2, config(2), {(1, 1): "prepare", (1, 2): "prepare"})
    for _ in range(400):
        if len([u for u in world.state.updates.values() if u.status == UpdateStatus.ABORTED]) == 2:
            break
        world.fair_round()
    assert [u.status for _, u in sorted(world.state.updates.items())] == [UpdateStatus.ABORTED] * 2
    return world


def test_after_two_aborts_the_lag_gate_still_admits_the_groups_of_the_next_step() -> None:
    world = aborted_twice()
    s = world.state
    assert s.policy_version == 0 and s.trainer.step == 2
    # the trainer's next step needs groups_per_step more groups: admitting them must be within the lag cap
    untrained = sum(1 for g in s.groups.values() if g.untrained)
    need = world.cfg.trainer.groups_per_step - min(untrained, world.cfg.trainer.groups_per_step)
    assert gates(s, world.cfg, max(need, 1), 0).lag_ok
    settle = run_to_the_end(world, [], set())
    assert settle < MAX_ROUNDS
    assert world.state.status == RunStatus.COMPLETED
    check_end(world)


def test_the_ranks_an_abort_names_are_quarantined_with_it_and_the_next_update_goes_ahead_without_them() -> None:
    world = World(2, config(2), {})
    world.fair_round()  # both joined
    world.die(1)
    for _ in range(400):
        if any(u.status == UpdateStatus.ABORTED for u in world.state.updates.values()):
            break
        world.fair_round()
    aborted = next(e for e in world.log if isinstance(e.payload, ev.UpdateAborted))
    i = world.log.index(aborted)
    assert isinstance(aborted.payload, ev.UpdateAborted) and aborted.payload.failed_ranks == (1,)
    after = world.log[i + 1].payload
    assert isinstance(after, ev.RankQuarantined) and after.rank == 1  # in the same decision
    run_to_the_end(world, [], {1})
    check_end(world)
    assert world.state.status == RunStatus.COMPLETED
    published = [u for u in world.state.updates.values() if u.status == UpdateStatus.PUBLISHED]
    assert published and all(u.ranks == [0] for u in published)


def test_a_drain_deadline_abort_names_and_quarantines_the_rank_that_did_not_drain() -> None:
    world = World(2, config(2), {})
    s = world.state
    for _ in range(400):  # up to the moment both ranks prepared v1 and the coordinator paused admission
        if (u := s.open_update) is not None and u.paused_at:
            break
        world.fair_round()
    world.die(1)  # rank 1 holds a group (or not) but never reports EnginePaused
    world.now += DEADLINE_S + 1.0
    decisions = decide_update(s, world.now, 1)
    undrained = [r for r in (0, 1) if not s.ranks[r].status.is_stopped]
    assert 1 in undrained
    assert decisions[0] == ev.UpdateAborted(
        version=s.open_update.version if s.open_update else 0,
        reason=f"drain deadline passed for ranks {undrained}",
        failed_ranks=tuple(undrained),
        fence=1,
    )
    assert {p.rank for p in decisions[1:] if isinstance(p, ev.RankQuarantined)} == set(undrained)


def test_max_consecutive_aborts_fails_the_run_naming_each_version_and_why() -> None:
    world = World(1, config(1, update={"prepare_deadline_s": 10.0, "max_consecutive_aborts": 2}), {})
    world.failures.update({(0, 1): "prepare", (0, 2): "prepare"})
    run_to_the_end(world, [], set())
    fin = world.log[-1].payload
    assert isinstance(fin, ev.RunFinished) and fin.status == RunStatus.FAILED
    assert fin.reason.startswith("2 updates aborted in a row (v1: rank 0: transfer: injected; v2: "), fin.reason


def test_no_rank_in_service_for_the_deadline_fails_the_run() -> None:
    world = World(1, config(1), {})
    while world.state.open_update is None:  # the only rank dies while v1 is being staged to it
        world.fair_round()
    world.die(0)
    run_to_the_end(world, [], {0})
    fin = world.log[-1].payload
    assert isinstance(fin, ev.RunFinished) and fin.status == RunStatus.FAILED
    assert fin.reason == f"no rank in service for {NO_RANK_S:g} s (ranks [0] quarantined)"
    quarantined = next(e for e in world.log if isinstance(e.payload, ev.RankQuarantined))
    assert world.log[-1].wall_time > quarantined.wall_time + NO_RANK_S


# ---------------------------------------------------------------- late results after a reclaim (reducer_rollout.py)
def test_an_update_staged_while_every_rank_is_quarantined_waits_for_one_to_rejoin_instead_of_aborting() -> None:
    """Nobody failed it, so it is no abort (an abort would count towards update.max_consecutive_aborts: a rank that
    failed two updates, rejoining between them, ended a one-rank run with 'v2: no rank in service')."""
    b = LogBuilder(ranks=1).start_run().stage(1).request_prepare(1).prepare_fail(1, 0)
    b.abort(1, "rank 0: transfer: checksum", failed_ranks=(0,)).quarantine(0, "v1 aborted").stage(2)
    staged = replay(b.build())
    assert not any(r.status.in_service for r in staged.ranks.values())
    now = staged.last_wall_time + 1.0
    assert decide_update(staged, now, 1) == []
    assert not [
        p for p in decide(staged, now, 1, AdmissionInputs(now=now, prompts=PROMPTS)) if isinstance(p, ev.UpdateAborted)
    ]
    rejoined = replay(b.join(0).build())
    (request,) = decide_update(rejoined, now, 1)
    assert isinstance(request, ev.PrepareRequested) and request.version == 2 and request.ranks == (0,)


def reclaimed_log(late_from: int) -> LogBuilder:
    """g000001 started on rank 0, reclaimed by rank 1 (its samples failed "worker lost"), then a result from
    `late_from` for one of them."""
    b = LogBuilder(ranks=2).start_run().admit("g000001")
    b.start("g000001/0", rank=0).start("g000001/1", rank=0)
    for i in (0, 1):
        b.emit(ev.SampleFailed(sample_id=f"g000001/{i}", group_id="g000001", index=i, rank=1, error="worker lost"))
    b.finish("g000001/0", rank=late_from)
    return b


def test_a_late_result_of_the_rank_that_lost_the_group_is_counted_not_an_anomaly() -> None:
    b = reclaimed_log(late_from=0)
    b.score("g000001/0")  # the reward worker may have scored it before it saw the reclaim
    b.emit(ev.SampleCancelled(sample_id="g000001/1", group_id="g000001", index=1, reason="cancelled while generating"))
    state = replay(b.build())
    assert state.anomalies == []
    assert state.late_results == 3
    assert state.reclaimed == {"g000001/0": 0, "g000001/1": 0}
    assert state.groups["g000001"].samples[0].status == SampleStatus.FAILED  # ignored: the reclaim stands


def test_the_same_result_from_any_other_rank_is_still_an_anomaly() -> None:
    state = replay(reclaimed_log(late_from=1).build())
    assert [a.message for a in state.anomalies] == ["sample g000001/0 already failed"]
    assert state.late_results == 0
