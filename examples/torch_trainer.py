"""A plain PyTorch training loop under rolledger, through the public client API only (`rolledger.client`).

Start a run without its built-in trainer, then this loop against it:

    rolledger run --trainer external --run-id demo --redis redis://127.0.0.1:6379/0 &
    python examples/torch_trainer.py --redis redis://127.0.0.1:6379/0 --run-id demo

The loss is written here, not imported: GRPO (group-normalised advantages, the PPO clip with the engine's logprobs
as the behaviour policy, one optimizer step per batch). Killed and started again, the loop continues from the
weights the log says it holds (`TrainerClient.restore`); its optimizer state starts afresh.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from rolledger.client import Batch, TrainerClient, UpdateFailed, policy_weights, token_logprobs


def completion_logprobs(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw logprobs [B, T] of each generated token under `model` (with grad), and the trajectories' loss masks."""
    rows = [list(t.prompt_token_ids) + list(t.token_ids) for t in batch.trajectories]
    width = max(len(r) for r in rows)
    gen = max(1, max(len(t.token_ids) for t in batch.trajectories))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    at = torch.zeros((len(rows), gen), dtype=torch.long)
    targets = torch.zeros_like(at)
    mask = torch.zeros((len(rows), gen))
    for b, (row, t) in enumerate(zip(rows, batch.trajectories, strict=True)):
        ids[b, : len(row)], attention[b, : len(row)] = torch.tensor(row), 1
        n, p = len(t.token_ids), len(t.prompt_token_ids)
        at[b, :n] = torch.arange(p - 1, p - 1 + n)  # the logits at position j predict token j + 1
        targets[b, :n] = torch.tensor(list(t.token_ids))
        mask[b, :n] = torch.tensor(list(t.loss_mask), dtype=torch.float32)  # the task's: 0 = not the policy's token
    logits = model(input_ids=ids, attention_mask=attention).logits.float()
    picked = logits.gather(1, at[:, :, None].expand(-1, -1, logits.shape[-1]))
    return torch.log_softmax(picked, -1).gather(-1, targets[:, :, None])[:, :, 0] * mask, mask


def advantages(batch: Batch) -> torch.Tensor:
    """Each sample's reward minus its group's mean, over the group's standard deviation (0 when all agree)."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(batch.trajectories):
        groups[t.group_id].append(i)
    out = torch.zeros(len(batch.trajectories))
    for rows in groups.values():
        r = [batch.rewards[i] for i in rows]
        mean, std = statistics.fmean(r), statistics.pstdev(r)
        for i in rows:
            out[i] = (batch.rewards[i] - mean) / (std + 1e-6)
    return out


def grpo_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Batch, clip: float) -> SimpleNamespace:
    model.train()
    new, mask = completion_logprobs(model, batch)
    old = torch.zeros_like(new)
    for b, t in enumerate(batch.trajectories):
        old[b, : len(t.logprobs)] = torch.tensor(list(t.logprobs))
    ratio = torch.exp((new - old) * mask)
    adv = advantages(batch)[:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    opt.zero_grad()
    loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        clipped = (((ratio - 1).abs() > clip).float() * mask).sum() / mask.sum().clamp(min=1.0)
        seq_gap = ((new - old) * mask).sum(1).abs().max()
    return SimpleNamespace(
        loss=float(loss),
        reward_mean=statistics.fmean(batch.rewards),
        max_seq_ratio=float(torch.exp(seq_gap)),
        clipped_frac=float(clipped),
    )


def train(redis_url: str, run_id: str, *, name: str, lr: float, clip: float, connect_timeout_s: float) -> int:
    torch.manual_seed(0)
    with TrainerClient.connect(redis_url, run_id, name=name, timeout_s=connect_timeout_s) as client:
        model = AutoModelForCausalLM.from_pretrained(client.model_dir, local_files_only=True, dtype=torch.float32)
        model.eval()
        restored = client.restore()
        restored.load_into(model)
        print(f"{name}: connected to {run_id}, weights v{restored.version}", flush=True)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        while (batch := client.next_batch(policy_weights(model))) is not None:
            client.agreement(batch, token_logprobs(model, batch.on_policy_trajectories))
            started = time.perf_counter()
            stats = grpo_step(model, opt, batch, clip)
            took_ms = (time.perf_counter() - started) * 1e3
            try:
                version = client.publish(batch, policy_weights(model), stats, train_ms=took_ms)
            except UpdateFailed as e:  # the old version keeps serving; the next batch trains on from ours
                print(f"{name}: step {batch.step}: {e}", flush=True)
                continue
            print(f"{name}: step {batch.step} published v{version} reward {stats.reward_mean:.3f}", flush=True)
        client.serve_until_finished()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis", required=True, help="the run's Redis URL")
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--name", default="torch-example-trainer", help="this trainer's producer name in the log")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--connect-timeout", type=float, default=600.0, help="seconds to wait for the run to start")
    args = ap.parse_args(argv)
    return train(
        args.redis, args.run_id, name=args.name, lr=args.lr, clip=args.clip, connect_timeout_s=args.connect_timeout
    )


if __name__ == "__main__":
    sys.exit(main())
