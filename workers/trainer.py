"""The trainer worker: an interpreter of `workflows.trainer.plan_step` that does the torch and staging I/O.

Per loop: fold the log; ask the decider for a plan (or why to wait); fetch the planned trajectories (kept from the
SampleFinished events it follows: data the reducer does not hold); measure the logprob gap of the on-policy ones
with the trainer's weights; if the gate refuses the step, append the plan's drops and the fact `TrainStepRefused`
(the coordinator's decider ends the run from it); else take the GRPO step, stage the new weights and append the drops,
BatchConsumed, TrainStepFinished and UpdateStaged as one batch with `EventLog.append_once` under the plan's key, so
version v is staged by one writer only. It keeps nothing the reducer knows: the step, the next version, the version
its weights are and whether it is halted all come from the state. Faults wrap `train` (workers/faults.py).

The model object is the trainer's weights; a respawned trainer in this process shares it, so its weights are the
last version staged, which is what `weights_version(state)` says.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import redis
import torch

from rolledger.events.store import RunClosed
from rolledger.schemas import events as ev
from rolledger.schemas.config import TrainerConfig
from rolledger.schemas.trajectory import Trajectory
from rolledger.workers.grpo import GrpoStats, grpo_step, make_optimizer, sequence_logprobs
from rolledger.workers.policy_model import policy_state
from rolledger.workers.runtime import Follower, Worker
from rolledger.workers.staging_format import StagingError
from rolledger.workers.staging_loader import VerifiedWeights
from rolledger.workers.staging_store import StagingStore
from rolledger.workers.transport import load_verified, own_copy_uri, read_manifest, serves_weights
from rolledger.workers.weights import state_digest
from rolledger.workflows.state import RunState
from rolledger.workflows.trainer import (
    TrainPlan,
    Wait,
    lineage,
    next_version,
    plan_step,
    refusal,
    versions_to_keep,
    weights_version,
)


def _stream_order(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


class TrainerLineageError(RuntimeError):
    """The trainer's weights do not descend from the run's log (workflows.trainer.lineage): it will not stage them."""


def check_lineage(model: torch.nn.Module, state: RunState) -> str:
    """The digest of the trainer's weights, which the next version is trained from; TrainerLineageError when they
    are neither its last staged version's nor the published ones (workflows.trainer.lineage): never stage weights
    that do not descend from the log's."""
    parent = state_digest(policy_state(model))
    allowed = lineage(state)
    if parent not in allowed:
        raise TrainerLineageError(
            f"the trainer's weights ({parent}) are neither its last staged version's nor the published ones "
            f"({', '.join(sorted(allowed))}): refusing to train v{next_version(state)} on them"
        )
    return parent


TrainFn = Callable[[Sequence[Trajectory], Sequence[float], TrainerConfig], GrpoStats]


class TrainerWorker(Worker):
    kind = "trainer"

    def __init__(
        self, client: redis.Redis, run_id: str, name: str, model: torch.nn.Module, staging: StagingStore
    ) -> None:
        super().__init__(client, run_id, name)
        self.model = model
        self.staging = staging
        self.follower = Follower(self.log)
        self.trajectories: dict[str, Trajectory] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.train: TrainFn = self._grpo  # one optimizer step; a fault wrapper may replace it
        self._restored = False

    def respawn(self) -> TrainerWorker:
        """A restarted trainer rebuilds its state and trajectories from the log; the model is the one it staged last."""
        return TrainerWorker(self.client, self.run_id, self.next_name(), self.model, self.staging)

    def run(self) -> None:
        while not self.stop_event.is_set():
            self._follow(block_ms=100)  # the whole log as of now: never a plan on a half-caught-up prefix
            if not self._restored:
                self._restore_weights()
            plan = plan_step(self.follower.state)
            if isinstance(plan, Wait):
                if self.follower.state.status.is_terminal:
                    break
                if plan.reason.is_final and not serves_weights(self.staging):
                    break
                continue  # a trainer that serves the weights (dist transport) stays until the run ends
            self.carry_out(plan)

    def _restore_weights(self) -> None:
        """Once caught up: make the model the weights the log says the trainer holds (the last version staged), so
        a trainer restarted as a fresh process (its model loaded at v0) measures and trains on the right weights.
        A respawn in this process already holds them; reloading them changes nothing.

        Under the dist transport the trainer's copy of a version is written while it is being served, and no rank
        can prepare it before the copy is complete. So a trainer killed mid-write may find its last version
        missing: that version was never published, and the trainer resumes from the published one (a warning says
        so; its next version is staged on that base, as every version is)."""
        state = self.follower.state
        if state.config is None:
            return  # RunStarted not folded yet
        self._restored = True
        v = weights_version(state)
        if v == 0:
            return
        try:
            staged = self._read_own(v)
        except StagingError as e:
            published = state.policy_version
            if v == published or e.kind != "not_found":
                raise
            self.logger.warning(
                "the trainer's copy of its last version was not complete when it stopped; that version was never "
                "published: resuming from the published one",
                lost=v,
                resumed=published,
            )
            if published == 0:
                return  # a fresh process holds v0 already
            v, staged = published, self._read_own(published)
        with torch.no_grad():
            for name, p in policy_state(self.model).items():
                p.copy_(staged.tensors[name])
        self.logger.info("weights restored from the log", version=v)

    def _read_own(self, version: int) -> VerifiedWeights:
        u = self.follower.state.updates[version]
        uri = own_copy_uri(self.staging, u.uri, version)
        return load_verified(uri, version, read_manifest(uri, version, expected_digest=u.manifest_digest))

    def _follow(self, block_ms: int) -> int:
        """Fold everything the log has after our position (to its last entry as of this call), keeping the
        trajectories; how many events came."""
        got = self.follower.catch_up(block_ms=block_ms)
        for stored in got:
            p = stored.event.payload
            if isinstance(p, ev.SampleFinished):
                self.trajectories[p.trajectory.trajectory_id] = p.trajectory
        return len(got)

    def _append(self, payloads: Sequence[ev.Payload], keys: Sequence[str]) -> bool:
        """Append the batch under its single-writer keys, then fold the log up to it so the next plan sees it;
        False when a key was taken (another trainer, or an earlier incarnation, recorded that step or group)."""
        events = [self.emitter.wrap(p, policy_version=self.follower.state.policy_version) for p in payloads]
        try:
            ids = self.log.append_once(events, keys)
        except RunClosed as exc:  # the run ended while this step was being taken: nothing more to record
            self.emitter.refused(exc, payloads)
            return False
        if ids is None:
            self.logger.warning("step already recorded by another writer", keys=list(keys))
        target = ids[-1] if ids else self.log.last_id()
        while target is not None and _stream_order(self.follower.last_id) < _stream_order(target):
            if self.stop_event.is_set():
                break
            self._follow(block_ms=100)
        return ids is not None

    def carry_out(self, plan: TrainPlan) -> None:
        cfg = self.follower.state.config
        assert cfg is not None  # a plan exists only for a running run
        if plan.batch is None:
            self._append(plan.drops, plan.once_keys)
            return
        batch = [self.trajectories[tid] for tid in plan.batch.trajectory_ids]
        on_policy = [self.trajectories[tid] for tid in plan.on_policy]
        gap_median, gap_p99 = logprob_agreement(self.model, on_policy)
        agreement_tokens = sum(len(t.token_ids) for t in on_policy)
        refused = refusal(plan, gap_median, gap_p99, agreement_tokens, cfg.trainer.max_logprob_gap)
        if refused is not None:
            self.logger.error("refusing the step: engine logprobs disagree with the trainer's weights", gap=gap_median)
            self._append([*plan.drops, refused], plan.refusal_keys)
            return
        parent = check_lineage(self.model, self.follower.state)
        started = time.perf_counter()
        stats = self.train(batch, plan.rewards, cfg.trainer)
        train_ms = (time.perf_counter() - started) * 1e3
        # versions nothing will read again go before the next is written: the store holds at most three
        collected = self.staging.gc(versions_to_keep(self.follower.state))
        if collected:
            self.logger.info("staged versions collected", versions=collected)
        staged = self.staging.stage(plan.version, plan.base_version, policy_state(self.model), parent_digest=parent)
        done = ev.TrainStepFinished(
            step=plan.step,
            loss=stats.loss,
            reward_mean=stats.reward_mean,
            logprob_gap_median=gap_median,
            logprob_gap_p99=gap_p99,
            agreement_tokens=agreement_tokens,
            max_seq_ratio=stats.max_seq_ratio,
            clipped_frac=stats.clipped_frac,
            train_ms=train_ms,
        )
        update = ev.UpdateStaged(
            version=plan.version,
            base_version=plan.base_version,
            manifest_digest=staged.manifest_digest,
            weights_digest=staged.manifest.weights_digest,
            uri=staged.uri,
            bytes=staged.bytes,
            tensors=len(staged.manifest.tensors),
            parent_weights_digest=parent,
        )
        if self._append([*plan.drops, plan.batch, done, update], plan.once_keys):
            for tid in plan.batch.trajectory_ids:
                self.trajectories.pop(tid, None)

    def _grpo(self, batch: Sequence[Trajectory], rewards: Sequence[float], cfg: TrainerConfig) -> GrpoStats:
        if self.optimizer is None:
            self.optimizer = make_optimizer(self.model, cfg.lr)
        self.model.train()
        try:
            return grpo_step(self.model, self.optimizer, batch, rewards, cfg)
        finally:
            self.model.eval()


@torch.no_grad()
def logprob_agreement(model: torch.nn.Module, trajectories: list[Trajectory]) -> tuple[float, float]:
    """Median and p99 of |trainer logprob - engine logprob| over the generated tokens (0, 0 for none), each compared
    in the mode the engine reported it: raw logprobs against the trainer's raw ones, processed logprobs against the
    trainer's recomputed with the trajectory's own temperature, top-k and top-p (workers.sampling). Comparing
    processed logprobs with raw ones would raise a false alarm at any temperature but 1."""
    if not trajectories:
        return 0.0, 0.0
    model.eval()
    by_mode: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        key = "raw" if t.logprob_mode == "raw" else t.sampling.model_dump_json()
        by_mode.setdefault(key, []).append(t)
    gaps: list[float] = []
    for same in by_mode.values():
        processed = None if same[0].logprob_mode == "raw" else same[0].sampling
        lp, _mask = sequence_logprobs(
            model, [t.prompt_token_ids for t in same], [t.token_ids for t in same], processed=processed
        )
        for row, t in enumerate(same):
            got = lp[row, : len(t.token_ids)].tolist()
            gaps.extend(abs(a - b) for a, b in zip(got, t.logprobs, strict=True))
    if not gaps:
        return 0.0, 0.0
    gaps.sort()
    return statistics.median(gaps), gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
