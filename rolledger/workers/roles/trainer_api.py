"""The trainer-side API's values (public through `rolledger.client`): what the client hands a training loop (`Batch`,
`Agreement`, `Restored`), what it needs of the loop's step (`StepStats`), what it raises (`ClientError` and its
kinds), and the two checks a loop may call on its own (`check_lineage`: the weights descend from the log;
`gap_stats`: the trainer's logprobs against the engine's). The client that produces and records them is
workers.roles.trainer_client.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rolledger.schemas.trajectory import Trajectory
from rolledger.workers.policy.policy_model import policy_state
from rolledger.workers.weights.tensors import state_digest
from rolledger.workflows.state import RunState
from rolledger.workflows.trainer import TrainPlan, lineage, next_version


class ClientError(RuntimeError):
    """A trainer-side failure the caller can act on; the message says what happened and what to do."""


class StepRefused(ClientError):
    """The agreement gate refused the step (recorded as TrainStepRefused; the run ends from it)."""


class UpdateFailed(ClientError):
    """The update transaction of a published version aborted: nothing committed, every rank kept the old version."""

    def __init__(self, version: int, reason: str, failures: Mapping[int, str]) -> None:
        self.version, self.reason, self.failures = version, reason, dict(failures)
        detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
        super().__init__(f"v{version} aborted: {reason}" + (f" ({detail})" if detail else ""))


class LineageError(ClientError):
    """The weights a step would train do not descend from the run's log (workflows.trainer.lineage)."""


class RunOver(ClientError):
    """The run finished while the client waited."""


@dataclass(frozen=True)
class Batch:
    """One step's work: what to train on, with everything that produced it.

    `trajectories[i]` scored `rewards[i]`; `on_policy` indexes the trajectories generated with the weights the
    trainer holds (the agreement is measured on them); `version` is the version this step will stage and
    `parent_digest` the weights digest it is trained from."""

    step: int
    version: int
    base_version: int
    weights_version: int
    parent_digest: str
    trajectories: tuple[Trajectory, ...]
    rewards: tuple[float, ...]
    lags: tuple[int, ...]  # per group of the batch, in `group_ids` order
    group_ids: tuple[str, ...]
    on_policy: tuple[int, ...]
    plan: TrainPlan

    @property
    def on_policy_trajectories(self) -> list[Trajectory]:
        return [self.trajectories[i] for i in self.on_policy]


@dataclass(frozen=True)
class Agreement:
    """|trainer - engine| logprob over the on-policy tokens: median, p99 and how many tokens (0: none measured)."""

    median: float
    p99: float
    tokens: int


class StepStats(Protocol):
    """What `publish` records of a step (workers.policy.grpo.GrpoStats has these; any object with them will do, e.g. a
    `types.SimpleNamespace(loss=..., reward_mean=..., max_seq_ratio=1.0, clipped_frac=0.0)`)."""

    @property
    def loss(self) -> float: ...
    @property
    def reward_mean(self) -> float: ...
    @property
    def max_seq_ratio(self) -> float: ...
    @property
    def clipped_frac(self) -> float: ...


@dataclass(frozen=True)
class Restored:
    """The weights this trainer holds per the log: `version` and its tensors (None at v0: the model directory's)."""

    version: int
    tensors: Mapping[str, torch.Tensor] | None

    def load_into(self, model: torch.nn.Module) -> None:
        """Copy these weights into `model`'s parameters (by `policy_state` name); at v0 there is nothing to copy:
        the model directory's weights are the run's."""
        if self.tensors is None:
            return
        with torch.no_grad():
            for name, p in policy_state(model).items():
                p.copy_(self.tensors[name])


def check_lineage(weights: Mapping[str, torch.Tensor] | str, state: RunState) -> str:
    """The digest of `weights` (a state dict, or its `state_digest`), which the next version is trained from;
    LineageError when they are neither the trainer's last staged version's nor the published ones
    (workflows.trainer.lineage): never stage weights that do not descend from the log's."""
    parent = weights if isinstance(weights, str) else state_digest(weights)
    allowed = lineage(state)
    if parent not in allowed:
        raise LineageError(
            f"the trainer's weights ({parent}) are neither its last staged version's nor the published ones "
            f"({', '.join(sorted(allowed))}): refusing to train v{next_version(state)} on them; load "
            "`TrainerClient.restore()`'s tensors (or the run's model directory at v0) first"
        )
    return parent


def gap_stats(trajectories: Sequence[Trajectory], logprobs: Sequence[Sequence[float]]) -> Agreement:
    """The agreement of the trainer's logprobs (one list per trajectory, one value per generated token) with the
    engine's recorded ones, over the tokens the engine generated: an episode's environment tokens (loss mask 0,
    no logprob) are left out."""
    if len(logprobs) != len(trajectories):
        raise ValueError(f"logprobs for {len(logprobs)} trajectories, the batch has {len(trajectories)} on-policy")
    gaps: list[float] = []
    for t, mine in zip(trajectories, logprobs, strict=True):
        if len(mine) != len(t.token_ids):
            raise ValueError(f"{t.trajectory_id}: {len(mine)} logprobs for {len(t.token_ids)} generated tokens")
        if t.turns:
            gaps.extend(abs(float(a) - b) for a, b, m in zip(mine, t.logprobs, t.loss_mask, strict=True) if m)
        else:
            gaps.extend(abs(float(a) - b) for a, b in zip(mine, t.logprobs, strict=True))
    if not gaps:
        return Agreement(0.0, 0.0, 0)
    gaps.sort()
    return Agreement(statistics.median(gaps), gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], len(gaps))
