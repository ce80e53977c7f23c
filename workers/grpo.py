"""The learning step: a supervised warm start and one GRPO update over scored rollout groups.

Owns:
- `warm_start(...)`: teacher-forced cross-entropy on (prompt, answer<eos>) pairs, loss on the completion only; a tiny
  model learns next to nothing from RL alone, so RL starts from a partially correct policy.
- `grpo_step(...)`: group-normalised advantages A = (r - mean_group) / (std_group + eps); the logprobs of the rollout
  tokens are recomputed with the current model (raw mode: log_softmax of the unmodified logits, the same quantity the
  engine reports by default); PPO-style clipped ratio loss against the rollout logprobs,
  L = -mean_tokens(min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)), the mean taken over every completion token of
  the batch; one optimizer step.
- `GrpoStats`: what TrainStepFinished reports, including how well the trainer's logprobs agree with the engine's.

The input is anything with `prompt_token_ids`, `token_ids` (the completion), `logprobs` (one per completion token, as
the engine reported them) and `group_id` (`TrajectoryLike`), so schemas' Trajectory objects fit as they are.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rolledger.schemas.config import SamplingParams, TrainerConfig
from rolledger.workers.sampling import processed_log_softmax
from rolledger.workers.tasks import SupervisedExample


class TrajectoryLike(Protocol):
    """What a GRPO step needs from one sample."""

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def logprobs(self) -> Sequence[float]: ...

    @property
    def group_id(self) -> Hashable: ...


@dataclass(frozen=True)
class RolloutSample:
    """A minimal TrajectoryLike for code that has no schemas Trajectory at hand (tests, benches)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    group_id: str


@dataclass(frozen=True)
class GrpoStats:
    loss: float
    reward_mean: float
    logprob_gap_median: float  # |recomputed - rollout| per completion token, before the update
    logprob_gap_p99: float
    max_seq_ratio: float  # exp(max over sequences of |sum of per-token (recomputed - rollout)|), >= 1
    clipped_frac: float  # fraction of completion tokens with |ratio - 1| > clip_eps
    tokens: int  # completion tokens in the loss
    groups: int
    zero_advantage_groups: int  # groups whose samples all scored the same (they carry no gradient)


def group_advantages(group_ids: Sequence[Hashable], rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """(r - group mean) / (group population std + eps) for each sample."""
    if len(group_ids) != len(rewards):
        raise ValueError(f"group_ids ({len(group_ids)}) and rewards ({len(rewards)}) differ in length")
    members: dict[Hashable, list[float]] = defaultdict(list)
    for g, r in zip(group_ids, rewards):
        members[g].append(float(r))
    stats = {g: (statistics.fmean(rs), statistics.pstdev(rs)) for g, rs in members.items()}
    return [(float(r) - stats[g][0]) / (stats[g][1] + eps) for g, r in zip(group_ids, rewards)]


def _pad_id(model: torch.nn.Module) -> int:
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    return int(pad) if pad is not None else 0


def sequence_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    processed: SamplingParams | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of each completion token under `model` (grad enabled), right-padded: ([B, T], mask [B, T]). Raw
    (log-softmax of the logits), or with `processed` the logprobs of the distribution sampled with those settings
    (what an engine reports in processed mode; torch_decode.processed_log_softmax)."""
    if len(prompts) != len(completions):
        raise ValueError(f"prompts ({len(prompts)}) and completions ({len(completions)}) differ in length")
    device = next(model.parameters()).device
    pad = _pad_id(model)
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    comp_width = max(1, max(len(c) for c in completions))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    attn = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    # position j of the output predicts token j+1; completion token k of row b sits at len(prompt_b) + k
    gather_pos = torch.zeros((len(prompts), comp_width), dtype=torch.long, device=device)
    targets = torch.full((len(prompts), comp_width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), comp_width), dtype=torch.float32, device=device)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        if not p:
            raise ValueError(f"row {b}: empty prompt_token_ids")
        seq = list(p) + list(c)
        ids[b, : len(seq)] = torch.tensor(seq, device=device)
        attn[b, : len(seq)] = 1
        if c:
            gather_pos[b, : len(c)] = torch.arange(len(p) - 1, len(p) - 1 + len(c), device=device)
            targets[b, : len(c)] = torch.tensor(list(c), device=device)
            mask[b, : len(c)] = 1.0
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    picked = logits.gather(1, gather_pos[:, :, None].expand(-1, -1, logits.shape[-1]))
    dist = torch.log_softmax(picked, dim=-1) if processed is None else processed_log_softmax(picked, processed)
    logprobs = dist.gather(-1, targets[:, :, None])[:, :, 0]
    return torch.where(mask > 0, logprobs, torch.zeros_like(logprobs)), mask


def _quantile(values: torch.Tensor, q: float) -> float:
    return float(torch.quantile(values.double(), q)) if values.numel() else 0.0


def grpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Sequence[TrajectoryLike],
    rewards: Sequence[float],
    cfg: TrainerConfig,
    *,
    max_grad_norm: float = 1.0,
) -> GrpoStats:
    """One GRPO update over `batch` (samples of one or more groups) with their `rewards`; see the module docstring."""
    if not batch:
        raise ValueError("grpo_step needs a non-empty batch")
    if len(batch) != len(rewards):
        raise ValueError(f"batch ({len(batch)}) and rewards ({len(rewards)}) differ in length")
    for i, s in enumerate(batch):
        if len(s.logprobs) != len(s.token_ids):
            raise ValueError(
                f"batch[{i}] (group {s.group_id!r}): {len(s.logprobs)} logprobs for {len(s.token_ids)} tokens"
            )
    group_ids = [s.group_id for s in batch]
    adv = group_advantages(group_ids, rewards)
    zero_groups = sum(
        1 for g in set(group_ids) if len({float(r) for gid, r in zip(group_ids, rewards) if gid == g}) == 1
    )

    model.train()
    new_lp, mask = sequence_logprobs(model, [s.prompt_token_ids for s in batch], [s.token_ids for s in batch])
    width = mask.shape[1]
    old_lp = torch.tensor(
        [list(s.logprobs) + [0.0] * (width - len(s.logprobs)) for s in batch], dtype=torch.float32
    ).to(new_lp.device)
    advantages = torch.tensor(adv, dtype=torch.float32, device=new_lp.device)[:, None]

    diff = (new_lp - old_lp) * mask
    ratio = torch.exp(diff)
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    tokens = int(mask.sum().item())
    loss = (per_token * mask).sum() / max(tokens, 1)

    optimizer.zero_grad(set_to_none=True)
    if tokens > 0:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
    model.eval()

    with torch.no_grad():
        valid = mask.bool()
        gaps = diff.detach().abs()[valid]
        seq_gap = diff.detach().sum(dim=1).abs().max().item()
        clip_active = ((ratio.detach() - 1.0).abs() > cfg.clip_eps)[valid]
    return GrpoStats(
        loss=float(loss.item()),
        reward_mean=float(statistics.fmean(float(r) for r in rewards)),
        logprob_gap_median=_quantile(gaps, 0.5),
        logprob_gap_p99=_quantile(gaps, 0.99),
        max_seq_ratio=float(math.exp(min(seq_gap, 50.0))),
        clipped_frac=float(clip_active.float().mean().item()) if clip_active.numel() else 0.0,
        tokens=tokens,
        groups=len(set(group_ids)),
        zero_advantage_groups=zero_groups,
    )


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """The optimizer the trainer uses for both phases (AdamW, no weight decay: the model is tiny)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group (the RL phase continues the warm start's optimizer)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def warm_start(
    model: torch.nn.Module,
    tokenizer: Any,
    examples: Sequence[SupervisedExample],
    steps: int,
    lr: float,
    seed: int,
    *,
    batch_size: int = 32,
    max_grad_norm: float = 1.0,
    optimizer: torch.optim.Optimizer | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Supervised warm start: `steps` AdamW steps on random batches of `examples`; returns the loss per step.
    `on_step(step, loss)` is called after each step (progress display).

    Each example is tokenized as prompt (with <bos>) followed by the completion and <eos>; the loss is the mean
    cross-entropy over the completion tokens only.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0 (got {steps})")
    if steps and not examples:
        raise ValueError("warm_start needs examples")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("tokenizer has no eos_token_id")
    encoded = [
        (
            list(tokenizer(ex.prompt)["input_ids"]),
            list(tokenizer(ex.completion, add_special_tokens=False)["input_ids"]) + [int(eos)],
        )
        for ex in examples
    ]
    rng = random.Random(f"warm_start:{seed}")
    if optimizer is None:
        optimizer = make_optimizer(model, lr)
    else:
        set_lr(optimizer, lr)
    losses: list[float] = []
    for _ in range(steps):
        rows = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
        model.train()
        lp, mask = sequence_logprobs(model, [p for p, _ in rows], [c for _, c in rows])
        loss = -(lp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        losses.append(float(loss.item()))
        if on_step is not None:
            on_step(len(losses), losses[-1])
    model.eval()
    return losses
