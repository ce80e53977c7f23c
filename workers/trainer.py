"""The trainer worker: consumes scored groups, takes GRPO steps, and stages each new version as an update.

Per step: take the oldest `groups_per_step` scored groups; drop (TrajectoryDropped) any whose lag exceeds the cap,
the second check after admission's; log BatchConsumed with every group's version and lag; recompute the logprobs of
the on-policy (lag 0) trajectories with the trainer's own weights and halt admission instead of training when they
disagree with what the engine reported (the weights did not arrive); take the step (TrainStepFinished); write the new
weights to the staging store and append UpdateStaged. It waits for that update to be published or aborted before
the next step, so at most one transaction is open.
"""

from __future__ import annotations

import statistics
import time

import redis
import torch

from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.schemas.trajectory import Trajectory
from rolledger.workers.faults import Injector
from rolledger.workers.grpo import grpo_step, make_optimizer, sequence_logprobs
from rolledger.workers.policy_model import policy_state
from rolledger.workers.runtime import Follower, Worker, WorkerKilled
from rolledger.workers.staging import DirectoryStagingStore
from rolledger.workflows.handoff import engines_asleep
from rolledger.workflows.state import GroupState, RunState


class TrainerWorker(Worker):
    kind = "trainer"

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        name: str,
        model: torch.nn.Module,
        staging: DirectoryStagingStore,
        *,
        injector: Injector | None = None,
    ) -> None:
        super().__init__(client, run_id, name)
        self.model = model
        self.staging = staging
        self.injector = injector or Injector()
        self.follower = Follower(self.log)
        self.trajectories: dict[str, Trajectory] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.halted = False
        self.model_version = 0  # the version the trainer's weights are: the last one it staged (published or not)

    def respawn(self) -> TrainerWorker:
        """A restarted trainer rebuilds its state and trajectories from the log; the model is the one it staged last."""
        fresh = TrainerWorker(
            self.client, self.run_id, self.next_name(), self.model, self.staging, injector=self.injector
        )
        fresh.model_version = self.model_version
        return fresh

    def run(self) -> None:
        while not self.stop_event.is_set():
            for stored in self.follower.poll(block_ms=100):
                p = stored.event.payload
                if isinstance(p, ev.SampleFinished):
                    self.trajectories[p.trajectory.trajectory_id] = p.trajectory
            state = self.follower.state
            if state.status in ("completed", "failed", "aborted"):
                break
            cfg = state.config
            if cfg is None or self.halted or state.trainer.step >= cfg.steps or state.open_update is not None:
                continue
            if cfg.mode == "colocated" and not engines_asleep(state):
                continue  # colocated: the trainer's turn comes only while every engine sleeps
            ready = sorted(state.ready_groups(), key=lambda g: g.group_id)
            if len(ready) >= cfg.trainer.groups_per_step:
                self.step(state, cfg, ready[: cfg.trainer.groups_per_step])

    def _lag(self, state: RunState, g: GroupState) -> int:
        return state.policy_version - min(g.versions or [g.admitted_version])

    def step(self, state: RunState, cfg: RunConfig, groups: list[GroupState]) -> None:
        delay = self.injector.take("delay-trainer")
        if delay is not None:
            time.sleep(delay.seconds)  # the injected fault itself: a slow trainer
        kill = self.injector.take("kill-worker", worker="trainer")
        if kill is not None:
            raise WorkerKilled("trainer killed before its step")
        step = state.trainer.step + 1
        drops: list[ev.Payload] = []
        kept: list[GroupState] = []
        for g in groups:
            lag = self._lag(state, g)
            if lag > cfg.admission.max_lag:
                drops.append(
                    ev.TrajectoryDropped(group_id=g.group_id, trajectory_ids=tuple(g.accepted), reason="lag", lag=lag)
                )
            else:
                kept.append(g)
        if not kept:
            self.emitter.emit(drops, policy_version=state.policy_version)
            return
        batch = [self.trajectories[tid] for g in kept for tid in g.accepted]
        rewards = [g.samples[int(tid.rsplit("/", 1)[1])].reward or 0.0 for g in kept for tid in g.accepted]
        lags = tuple(self._lag(state, g) for g in kept)
        consumed = ev.BatchConsumed(
            step=step,
            group_ids=tuple(g.group_id for g in kept),
            versions=tuple(min(g.versions or [g.admitted_version]) for g in kept),
            lags=lags,
            trajectory_ids=tuple(t.trajectory_id for t in batch),
            bytes=sum(g.bytes for g in kept),
        )
        # agreement is only defined where the engine ran the very weights the trainer holds
        on_policy = [t for t in batch if t.policy_version == self.model_version]
        gap_median, gap_p99 = logprob_agreement(self.model, on_policy)
        agreement_tokens = sum(len(t.token_ids) for t in on_policy)
        if gap_median > cfg.trainer.max_logprob_gap:
            self.halted = True
            why = (
                f"logprob agreement lost on v{self.model_version}: median gap {gap_median:.4f} > "
                f"{cfg.trainer.max_logprob_gap:g} over {agreement_tokens} on-policy tokens; the weights did not "
                "arrive; not training on it"
            )
            self.emitter.emit(
                [
                    *drops,
                    ev.AdmissionPaused(reason="manual", detail=why),
                    ev.RunFinished(status="failed", reason=why, steps=state.trainer.step),
                ],
                policy_version=state.policy_version,
            )
            self.logger.error("halting: engine logprobs disagree with the trainer's weights", gap=gap_median)
            return
        if self.optimizer is None:
            self.optimizer = make_optimizer(self.model, cfg.trainer.lr)
        started = time.perf_counter()
        self.model.train()
        stats = grpo_step(self.model, self.optimizer, batch, rewards, cfg.trainer)
        self.model.eval()
        train_ms = (time.perf_counter() - started) * 1e3
        version = max([*state.updates, state.policy_version]) + 1
        staged = self.staging.stage(version, state.policy_version, policy_state(self.model))
        self.model_version = version
        self.emitter.emit(
            [
                *drops,
                consumed,
                ev.TrainStepFinished(
                    step=step,
                    loss=stats.loss,
                    reward_mean=stats.reward_mean,
                    logprob_gap_median=gap_median,
                    logprob_gap_p99=gap_p99,
                    agreement_tokens=agreement_tokens,
                    max_seq_ratio=stats.max_seq_ratio,
                    clipped_frac=stats.clipped_frac,
                    train_ms=train_ms,
                ),
                ev.UpdateStaged(
                    version=version,
                    base_version=state.policy_version,
                    manifest_digest=staged.manifest_digest,
                    weights_digest=staged.manifest.weights_digest,
                    uri=staged.uri,
                    bytes=staged.bytes,
                    tensors=len(staged.manifest.tensors),
                ),
            ],
            policy_version=state.policy_version,
        )
        for tid in consumed.trajectory_ids:
            self.trajectories.pop(tid, None)


@torch.no_grad()
def logprob_agreement(model: torch.nn.Module, trajectories: list[Trajectory]) -> tuple[float, float]:
    """Median and p99 of |trainer logprob - engine logprob| over the generated tokens (0, 0 for none)."""
    if not trajectories:
        return 0.0, 0.0
    model.eval()
    lp, _mask = sequence_logprobs(
        model, [t.prompt_token_ids for t in trajectories], [t.token_ids for t in trajectories]
    )
    gaps: list[float] = []
    for row, t in enumerate(trajectories):
        n = len(t.token_ids)
        got = lp[row, :n].tolist()
        gaps.extend(abs(a - b) for a, b in zip(got, t.logprobs, strict=True))
    if not gaps:
        return 0.0, 0.0
    gaps.sort()
    return statistics.median(gaps), gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
