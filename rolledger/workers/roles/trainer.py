"""The built-in trainer: a GRPO loop on CPU, written on the public client API (workers/roles/trainer_client.py), the same
path any user's training loop takes.

Per step: `next_batch` (the decider's plan, with the weights' lineage checked), the trainer's logprobs of the
on-policy tokens in each trajectory's mode (`token_logprobs`) through the `agreement` gate, one GRPO optimizer step,
and `publish` (staged with its manifest and recorded as one batch under the step's single-writer keys; the next
`next_batch` waits while the update is open; with `trainer.overlap_update` it trains the next step beside it
and `publish` records that step once the update closes). It keeps nothing the reducer knows. Faults wrap `train`
(workers/operator/faults.py).

The model object is the trainer's weights; a respawned trainer in this process shares it and, like a restarted
process, first makes it the weights the log says the trainer holds (`TrainerClient.restore`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import redis
import torch

from rolledger.events.disk_full import DiskFull, has_room, is_disk_full
from rolledger.schemas.config import TrainerConfig
from rolledger.schemas.trajectory import Trajectory
from rolledger.workers.policy.grpo import GrpoStats, grpo_step, make_optimizer, sequence_logprobs
from rolledger.workers.policy.policy_model import load_policy, policy_state
from rolledger.workers.roles.trainer_api import Batch, RunOver, StepRefused, gap_stats
from rolledger.workers.roles.trainer_client import TrainerClient
from rolledger.workers.runtime.runtime import Follower, Worker
from rolledger.workers.weights.staging_store import StagingStore
from rolledger.workers.weights.tensors import state_digest
from rolledger.workflows.trainer import lineage

TrainFn = Callable[[Sequence[Trajectory], Sequence[float], TrainerConfig], GrpoStats]


class TrainerWorker(Worker):
    kind = "trainer"

    def __init__(
        self, client: redis.Redis, run_id: str, name: str, model: torch.nn.Module, staging: StagingStore
    ) -> None:
        super().__init__(client, run_id, name)
        self.model = model
        self.staging = staging
        self.seat = TrainerClient(client, run_id, name, staging, stop=self.stop_event)
        self.optimizer: torch.optim.Optimizer | None = None
        self.train: TrainFn = self._grpo  # one optimizer step; a fault wrapper may replace it

    @property
    def follower(self) -> Follower:
        """The client's: what the log says."""
        return self.seat.follower

    def respawn(self) -> TrainerWorker:
        """A restarted trainer rebuilds its state and trajectories from the log and restores the weights it holds."""
        return TrainerWorker(self.client, self.run_id, self.next_name(), self.model, self.staging)

    def run(self) -> None:
        self._restore_weights()
        while not self.stop_event.is_set():
            try:
                batch = self.seat.next_batch(policy_state(self.model))
            except RunOver:
                return
            if batch is None:
                self.seat.serve_until_finished()  # a trainer that serves the weights stays until the run ends
                return
            try:
                self.carry_out(batch)
            except RunOver:  # the run ended (or this trainer was stopped) while the step waited: nothing to record
                return

    def _restore_weights(self) -> None:
        """Make the model the weights the log says the trainer holds, so a trainer restarted as a fresh process (its
        model loaded at v0) measures and trains on the right weights; a respawn in this process may hold weights
        trained after its last staged version, which this puts back."""
        restored = self.seat.restore()
        if restored.tensors is None:
            self._restore_initial_weights()
            return
        restored.load_into(self.model)
        self.logger.info("weights restored from the log", version=restored.version)
        self.optimizer = load_optimizer(self._checkpoints, restored.version, self.model, self.seat.config.trainer.lr)
        if self.optimizer is None:
            self.logger.warning(
                "no optimizer state saved with this version: its moments start afresh", version=restored.version
            )

    def _restore_initial_weights(self) -> None:
        """At v0 the log's weights are the run's model directory's. A trainer respawned in this process after its
        predecessor trained a step it never staged (its append failed) holds other weights: load the directory's
        back, or every respawn would refuse the step on lineage, forever."""
        if state_digest(policy_state(self.model)) in lineage(self.follower.state):
            return
        initial, _ = load_policy(self.seat.model_dir)
        weights = policy_state(initial)
        with torch.no_grad():
            for name, p in policy_state(self.model).items():
                p.copy_(weights[name])
        self.optimizer = None
        self.logger.info("initial weights restored from the model directory", model_dir=str(self.seat.model_dir))

    @property
    def _checkpoints(self) -> Path:
        return self.staging.root.parent / "trainer-state"

    def carry_out(self, batch: Batch) -> None:
        cfg = self.seat.config
        try:
            self.seat.agreement(batch, token_logprobs(self.model, batch.on_policy_trajectories))
        except StepRefused as e:
            self.logger.error("refusing the step: engine logprobs disagree with the trainer's weights", reason=str(e))
            return
        started = time.perf_counter()
        stats = self.train(batch.trajectories, batch.rewards, cfg.trainer)
        train_ms = (time.perf_counter() - started) * 1e3
        version = self.seat.publish(batch, policy_state(self.model), stats, train_ms=train_ms, wait=False)
        every = cfg.trainer.checkpoint_every
        if every and self.optimizer is not None and version % every == 0:
            try:
                save_optimizer(self._checkpoints, version, self.optimizer)
            except Exception as e:
                if not is_disk_full(e):
                    raise
                # the version is staged and recorded; without its optimizer state a restart starts fresh moments
                self.logger.error(f"optimizer state of v{version} not saved: {' '.join(str(e).split())}")

    def _grpo(self, batch: Sequence[Trajectory], rewards: Sequence[float], cfg: TrainerConfig) -> GrpoStats:
        if self.optimizer is None:
            self.optimizer = make_optimizer(self.model, cfg.lr)
        self.model.train()
        try:
            return grpo_step(self.model, self.optimizer, batch, rewards, cfg)
        finally:
            self.model.eval()


@torch.no_grad()
def token_logprobs(model: torch.nn.Module, trajectories: Sequence[Trajectory]) -> list[list[float]]:
    """The model's logprob of every generated token of each trajectory, in the mode its engine reported: raw
    log-softmax, or processed (recomputed with the trajectory's own temperature, top-k and top-p, workers.policy.sampling).
    Comparing processed logprobs with raw ones would raise a false alarm at any temperature but 1."""
    out: list[list[float]] = [[] for _ in trajectories]
    if not trajectories:
        return out
    model.eval()
    by_mode: dict[str, list[int]] = {}
    for i, t in enumerate(trajectories):
        by_mode.setdefault("raw" if t.logprob_mode == "raw" else t.sampling.model_dump_json(), []).append(i)
    for rows in by_mode.values():
        same = [trajectories[i] for i in rows]
        processed = None if same[0].logprob_mode == "raw" else same[0].sampling
        lp, _mask = sequence_logprobs(
            model, [t.prompt_token_ids for t in same], [t.token_ids for t in same], processed=processed
        )
        for row, (i, t) in enumerate(zip(rows, same, strict=True)):
            out[i] = lp[row, : len(t.token_ids)].tolist()
    return out


def logprob_agreement(model: torch.nn.Module, trajectories: list[Trajectory]) -> tuple[float, float]:
    """Median and p99 of |trainer logprob - engine logprob| over the generated tokens (0, 0 for none)."""
    got = gap_stats(trajectories, token_logprobs(model, trajectories))
    return got.median, got.p99


def _optimizer_path(root: Path, version: int) -> Path:
    return root / f"optimizer-v{version:06d}.pt"


def save_optimizer(root: Path, version: int, optimizer: torch.optim.Optimizer, keep: int = 2) -> Path:
    """Save the optimizer's state as of staged `version`, atomically (a temporary file renamed into place); the
    newest `keep` are kept."""
    root.mkdir(parents=True, exist_ok=True)
    final = _optimizer_path(root, version)
    tmp = root / f".{final.name}.{os.getpid()}.tmp"
    try:
        torch.save(optimizer.state_dict(), tmp)
        os.replace(tmp, final)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        # torch.save names no errno ("[enforce fail at inline_container.cc] unexpected pos"): a failed write on a
        # filesystem with (next to) no room left is taken for a full disk
        if is_disk_full(e) or (isinstance(e, (OSError, RuntimeError)) and not has_room(root, 1 << 20)):
            raise DiskFull(tmp, f"optimizer state of v{version}", e) from e
        raise
    for old in sorted(root.glob("optimizer-v*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return final


def load_optimizer(root: Path, version: int, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer | None:
    """The optimizer with the state saved with `version` (the weights the trainer resumes from), None when none was
    saved for that version (a state of another version would not match the weights)."""
    path = _optimizer_path(root, version)
    if not path.is_file():
        return None
    optimizer = make_optimizer(model, lr)
    optimizer.load_state_dict(torch.load(path, weights_only=True))
    return optimizer
