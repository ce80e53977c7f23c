"""The scheduler (workflows/scheduler.py) through the pure admission decider and the reducer: SRGF orders by an
estimate that needs no ground truth, its fairness bound holds on a half-short, half-long workload (nothing starves),
the estimate's error is telemetry, and the byte gate counts every in-flight group at its `max_tokens`.

The workload is simulated in logical time, in the test: a group admitted at tick t finishes all its samples at
t + (its prompt's completion length), so short groups free their slots sooner, as they would on an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from logbuilder import LogBuilder

from rolledger.events.envelope import make_event
from rolledger.schemas import events as ev
from rolledger.schemas.config import AdmissionConfig, RunConfig, SamplingParams, TrainerConfig
from rolledger.schemas.trajectory import Trajectory
from rolledger.workflows.admission import AdmissionInputs, decide_admission, gates
from rolledger.workflows.groups import decide_groups
from rolledger.workflows.reducer import fold, replay
from rolledger.workflows.scheduler import PromptItem, completion_cap, est_completion_tokens, estimate_error
from rolledger.workflows.state import RunState

SHORT, LONG = 2, 24  # completion tokens of a short and of a long prompt
MAX_TOKENS = 32


def workload(count: int) -> tuple[list[PromptItem], dict[str, int]]:
    """Half short, half long prompts, interleaved at random (a fixed shuffle); long prompts are longer prompts too,
    as in a real task, so the estimate has something to learn from before it has seen a prompt twice."""
    import random

    kinds = [SHORT] * (count // 2) + [LONG] * (count // 2)
    random.Random(7).shuffle(kinds)
    prompts = [
        PromptItem(i, f"p{i}", tuple(range(3)) if k == SHORT else tuple(range(20)), "5") for i, k in enumerate(kinds)
    ]
    return prompts, {p.prompt_id: k for p, k in zip(prompts, kinds, strict=True)}


def config(scheduler: str, max_wait_rounds: int) -> RunConfig:
    return RunConfig.model_validate(
        {
            "group_size": 2,
            "scheduler": scheduler,
            "sampling": SamplingParams(max_tokens=MAX_TOKENS),
            "trainer": TrainerConfig(groups_per_step=2),
            "admission": AdmissionConfig(
                max_inflight_groups=4,
                max_queued_bytes=1 << 40,
                max_lag=1 << 20,
                throttle_to_drain_rate=False,
                max_wait_rounds=max_wait_rounds,
            ),
        }
    )


@dataclass
class Sim:
    """The run's log folded as it is decided: admission and group completion by the pure deciders, generation by the
    test's clock."""

    state: RunState
    prompts: list[PromptItem]
    length: dict[str, int]
    admitted: list[ev.GroupAdmitted] = field(default_factory=list)
    due: dict[str, int] = field(default_factory=dict)  # group id -> tick its samples finish

    def emit(self, *payloads: ev.Payload) -> None:
        for p in payloads:
            fold(self.state, make_event(p, run_id="r", producer="test", policy_version=0))

    def tick(self, now: int) -> None:
        for gid, at in list(self.due.items()):
            if at <= now:
                del self.due[gid]
                self._finish(gid)
        self.emit(*decide_groups(self.state, float(now)))
        decided = decide_admission(self.state, AdmissionInputs(now=float(now), prompts=self.prompts))
        self.emit(*decided)
        for p in decided:
            if isinstance(p, ev.GroupAdmitted):
                self.admitted.append(p)
                self.due[p.group_id] = now + self.length[p.prompt_id.split("@")[0]]
                self.emit(
                    *[
                        ev.SampleStarted(
                            sample_id=f"{p.group_id}/{i}",
                            group_id=p.group_id,
                            index=i,
                            rank=0,
                            policy_version=0,
                            weights_digest="w",
                        )
                        for i in range(p.n)
                    ]
                )

    def _finish(self, gid: str) -> None:
        g = self.state.groups[gid]
        tokens = self.length[g.prompt_id.split("@")[0]]
        for i in range(g.n):
            t = Trajectory(
                trajectory_id=f"{gid}/{i}",
                group_id=gid,
                prompt_id=g.prompt_id,
                index=i,
                prompt_token_ids=[1] * g.prompt_tokens,
                token_ids=[7] * tokens,
                loss_mask=[1] * tokens,
                positions=list(range(g.prompt_tokens, g.prompt_tokens + tokens)),
                logprobs=[-0.5] * tokens,
                logprob_mode="raw",
                finish_reason="stop",
                sampling=SamplingParams(max_tokens=MAX_TOKENS),
                policy_version=0,
                weights_digest="w",
                rank=0,
                engine="torch",
                cache_generation=0,
                graph_generation=0,
            )
            self.emit(ev.SampleFinished(trajectory=t, gen_ms=1.0))


def simulate(scheduler: str, max_wait_rounds: int, prompts: int = 64, ticks: int = 400) -> Sim:
    items, length = workload(prompts)
    cfg = config(scheduler, max_wait_rounds)
    sim = Sim(replay(LogBuilder(cfg).start_run().build()), items, length)
    for now in range(ticks):
        sim.tick(now)
    return sim


def overtaken_at_admission(admitted: list[ev.GroupAdmitted]) -> list[int]:
    """For each admission, how many prompts after it in the sequence had been admitted before it."""
    out = []
    for j, p in enumerate(admitted):
        assert p.prompt_index is not None
        out.append(sum(1 for q in admitted[:j] if q.prompt_index is not None and q.prompt_index > p.prompt_index))
    return out


def test_srgf_admits_every_prompt_within_its_fairness_bound_on_half_short_half_long_prompts() -> None:
    sim = simulate("srgf", max_wait_rounds=2)
    bound = 2 * 2  # max_wait_rounds x groups_per_step
    first_epoch = [p for p in sim.admitted if p.prompt_index is not None and p.prompt_index < 64]
    assert sorted(p.prompt_index or 0 for p in first_epoch) == list(range(64)), "a prompt of the first epoch never came"
    overtaken = overtaken_at_admission(sim.admitted)
    assert max(overtaken) <= bound
    # SRGF did reorder: short prompts overtook long ones, up to the bound, and each group was admitted once
    assert max(overtaken) == bound
    assert len({p.prompt_index for p in sim.admitted}) == len(sim.admitted)
    long_share = sum(sim.length[p.prompt_id.split("@")[0]] == LONG for p in first_epoch) / len(first_epoch)
    assert long_share == 0.5


def test_without_the_fairness_bound_srgf_lets_long_prompts_wait_far_longer() -> None:
    """The control: the same workload with the bound lifted overtakes some long prompt far more often (what the
    bound prevents); FIFO never overtakes."""
    unbounded = max(overtaken_at_admission(simulate("srgf", max_wait_rounds=1_000).admitted))
    assert unbounded > 3 * (2 * 2)
    assert max(overtaken_at_admission(simulate("fifo", max_wait_rounds=2).admitted)) == 0


def test_srgf_finishes_more_groups_than_fifo_in_the_same_time() -> None:
    """What SRGF is for: with slots freed by short groups sooner, more groups complete by the same tick."""
    srgf, fifo = simulate("srgf", 2, ticks=200), simulate("fifo", 2, ticks=200)
    done = [s.state.admission.admitted - s.state.admission.inflight for s in (srgf, fifo)]
    assert done[0] > done[1]


def test_the_estimate_learns_from_observed_lengths_and_its_error_is_reported() -> None:
    items, length = workload(8)
    cfg = config("srgf", 2)
    sim = Sim(replay(LogBuilder(cfg).start_run().build()), items, length)
    short = next(p for p in items if length[p.prompt_id] == SHORT)
    # nothing observed: the sampling cap
    assert est_completion_tokens(sim.state, cfg, short.prompt_id, len(short.token_ids)) == MAX_TOKENS
    assert estimate_error(sim.state.scheduler) == (0.0, 0.0)
    for now in range(60):
        sim.tick(now)
    # seen: its own mean, in a later epoch too; an unseen prompt of a seen length: its length bucket's mean
    assert est_completion_tokens(sim.state, cfg, short.prompt_id, len(short.token_ids)) == SHORT
    assert est_completion_tokens(sim.state, cfg, f"{short.prompt_id}@3", len(short.token_ids)) == SHORT
    assert est_completion_tokens(sim.state, cfg, "never-seen", 20) == LONG
    # the error: the first groups were admitted at the cap, later ones at the learned lengths
    first = sim.admitted[0]
    assert first.est_remaining_tokens == MAX_TOKENS * first.n
    mean_abs, mean_signed = estimate_error(sim.state.scheduler)
    assert 0 < mean_abs < MAX_TOKENS - SHORT
    assert mean_signed > 0  # the cap overestimates
    expected = [p.est_remaining_tokens // p.n - length[p.prompt_id.split("@")[0]] for p in sim.admitted]
    finished = [e for e, p in zip(expected, sim.admitted, strict=True) if p.group_id not in sim.due]
    assert mean_abs == pytest.approx(sum(abs(x) for x in finished) / len(finished))


def test_in_flight_groups_count_at_max_tokens_so_the_byte_cap_holds_whatever_they_generate() -> None:
    """Every group generates the full `max_tokens`: the bytes the trainer would then hold never exceed the cap."""
    items, _ = workload(16)
    cfg = config("fifo", 2).model_copy(
        update={"admission": AdmissionConfig(max_queued_bytes=6_000, max_lag=1 << 20, throttle_to_drain_rate=False)}
    )
    sim = Sim(
        replay(LogBuilder(cfg).start_run().build()), items, dict.fromkeys((p.prompt_id for p in items), MAX_TOKENS)
    )
    for now in range(200):
        sim.tick(now)
        g = gates(sim.state, cfg, 0, 0)
        assert sim.state.admission.queued_bytes <= cfg.admission.max_queued_bytes
        assert g.projected_bytes <= cfg.admission.max_queued_bytes
    assert sim.admitted, "nothing was admitted under the cap"


def test_srgf_estimates_an_episode_across_its_turns_not_as_one_turn() -> None:
    """A task with an environment (issue 40): a sample is an episode of turns, each policy turn at most
    `sampling.max_tokens`, the whole at most `task.max_episode_tokens`. Before anything is observed a group is
    estimated at the episode's budget, and what is learned is an episode's length across its turns (24 tokens here,
    three times a turn's cap of 8), not clamped to one turn: SRGF still tells short episodes from long ones."""
    items, length = workload(8)
    base = config("srgf", 2)
    cfg = base.model_copy(
        update={
            "sampling": SamplingParams(max_tokens=8),
            "task": base.task.model_copy(
                update={"env": "plugins_for_tests:counting_env", "max_turns": 4, "max_episode_tokens": MAX_TOKENS}
            ),
        }
    )
    assert completion_cap(cfg) == MAX_TOKENS and completion_cap(base) == MAX_TOKENS
    assert completion_cap(base.model_copy(update={"sampling": SamplingParams(max_tokens=8)})) == 8
    sim = Sim(replay(LogBuilder(cfg).start_run().build()), items, length)
    short = next(p for p in items if length[p.prompt_id] == SHORT)
    long = next(p for p in items if length[p.prompt_id] == LONG)
    assert est_completion_tokens(sim.state, cfg, short.prompt_id, len(short.token_ids)) == MAX_TOKENS
    for now in range(60):
        sim.tick(now)
    assert sim.admitted[0].est_remaining_tokens == MAX_TOKENS * sim.admitted[0].n  # the episode's budget, not 8
    assert est_completion_tokens(sim.state, cfg, long.prompt_id, len(long.token_ids)) == LONG  # > one turn's 8
    assert est_completion_tokens(sim.state, cfg, short.prompt_id, len(short.token_ids)) == SHORT
    # later admissions were ordered by those estimates: the learned long episodes were estimated past one turn
    learned = [p.est_remaining_tokens // p.n for p in sim.admitted[4:]]
    assert LONG in learned and SHORT in learned, learned
