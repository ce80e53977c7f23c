"""TRL's GRPO loss under rolledger, through the public client API only (`rolledger.client`).

Start a run without its built-in trainer, then this loop against it (needs `pip install trl`):

    rolledger run --trainer external --run-id demo --redis redis://127.0.0.1:6379/0 &
    python examples/trl_trainer.py --redis redis://127.0.0.1:6379/0 --run-id demo

rolledger generates, scores, batches and publishes; TRL computes the loss. The loop builds a `trl.GRPOTrainer` on
the run's own checkpoint (`client.model_dir`, CPU, no generation, no vLLM, no reward model: the trainer is only asked
for its loss) and, for every batch, feeds `GRPOTrainer.compute_loss` the tensors TRL's own generation step would
have produced: left-padded prompts, right-padded completions, advantages normalised per group the way
`GRPOTrainer` does it (reward minus the group mean, over TRL's `nanstd` + 1e-4), and as `old_per_token_logps` the
engine's logprobs from the trajectories, so TRL's importance ratio is taken against the policy that sampled them.
Then `loss.backward()`, one AdamW step, `client.publish`. Gradients are not clipped by default, as in
examples/torch_trainer.py: with TRL's own default (`--max-grad-norm 1.0`) the small policy of the tests learns
more slowly (reward 0.52 -> 0.58 over 30 steps in two runs; 0.53 -> 0.58 to 0.68 without clipping).

The loss is TRL's default (`loss_type="dapo"`: the PPO clip, summed over tokens, divided by the batch's token count),
`--loss-type grpo` / `bnpo` / `dr_grpo` / `cispo` / `sapo` pick another of TRL's formulations. TRL scores tokens at
`temperature=1.0`, i.e. raw logprobs, which is what rolledger's engines report by default. Nothing is fetched from
the network: the model and tokenizer are the run's local checkpoint (`HF_HUB_OFFLINE=1` is set before TRL loads).
Killed and started again, the loop continues from the weights the log says it holds (`TrainerClient.restore`).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers / TRL read it: never reach for the Hub

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from types import SimpleNamespace

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import nanstd

from rolledger.client import Batch, TrainerClient, UpdateFailed, policy_weights, token_logprobs


def rewards_come_from_the_run(completions: list[object], **_: object) -> list[float]:
    """GRPOTrainer insists on a reward source; it is never called: rolledger's scorers reward every trajectory."""
    raise AssertionError("TRL was asked to score completions; in this loop the run scores them")


def build_trainer(
    model_dir: str, workdir: str, *, loss_type: str, lr: float, clip: float, max_grad_norm: float
) -> GRPOTrainer:
    """A GRPOTrainer on the run's checkpoint, used for its loss only: rolledger does the generation and the rewards."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    args = GRPOConfig(
        output_dir=workdir,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        loss_type=loss_type,
        learning_rate=lr,  # what TRL's own optimizer would use; ours takes the same value
        epsilon=clip,
        max_grad_norm=max_grad_norm,
        beta=0.0,  # no reference model (TRL's default)
        temperature=1.0,  # raw logprobs, as the engine reports them
        activation_checkpointing=False,
        disable_dropout=True,
        # GRPOConfig checks these against each other; they size TRL's own generation, which is never run here
        num_generations=2,
        per_device_train_batch_size=2,
    )
    # TRL wants a dataset to generate from; it is never used: the batches come from the run
    placeholder = Dataset.from_dict({"prompt": ["unused"]})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=rewards_come_from_the_run,
        args=args,
        train_dataset=placeholder,
        processing_class=tokenizer,
    )
    # transformers' training loop sets this per optimizer step; here each batch is one step without accumulation
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def trl_advantages(batch: Batch) -> torch.Tensor:
    """GRPOTrainer's group-scaled advantages (scale_rewards="group"): (reward - group mean) / (group nanstd + 1e-4),
    0 where a group's rewards all agree; groups may be of any size, rows stay in `batch.trajectories` order."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(batch.trajectories):
        groups[t.group_id].append(i)
    rewards = torch.tensor(batch.rewards, dtype=torch.float32)
    out = torch.zeros_like(rewards)
    for rows in groups.values():
        r = rewards[rows]
        std = nanstd(r) if len(rows) > 1 else torch.zeros(())
        out[rows] = (r - torch.nanmean(r)) / (std + 1e-4)
    return torch.nan_to_num(out, nan=0.0)


def trl_inputs(batch: Batch, pad_id: int) -> dict[str, torch.Tensor]:
    """The dict GRPOTrainer's generation step hands `compute_loss`: prompts left-padded, completions right-padded."""
    trajs = batch.trajectories
    p_width = max(len(t.prompt_token_ids) for t in trajs)
    c_width = max(1, max(len(t.token_ids) for t in trajs))
    prompt_ids = torch.full((len(trajs), p_width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.full((len(trajs), c_width), pad_id, dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    old = torch.zeros((len(trajs), c_width))
    for b, t in enumerate(trajs):
        p, n = len(t.prompt_token_ids), len(t.token_ids)
        prompt_ids[b, p_width - p :] = torch.tensor(list(t.prompt_token_ids))
        prompt_mask[b, p_width - p :] = 1
        completion_ids[b, :n] = torch.tensor(list(t.token_ids))
        completion_mask[b, :n] = 1
        old[b, :n] = torch.tensor(list(t.logprobs))  # the behaviour policy: the engine that sampled the tokens
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": trl_advantages(batch),
        "old_per_token_logps": old,
        "num_items_in_batch": completion_mask.sum(),  # the token count TRL's "dapo" / "cispo" losses divide by
    }


def trl_step(
    trainer: GRPOTrainer, opt: torch.optim.Optimizer, batch: Batch, before: list[list[float]]
) -> SimpleNamespace:
    """One optimizer step on TRL's loss; `before` is the model's logprob of each trajectory's tokens before it."""
    model = trainer.model
    assert model is not None and trainer.processing_class is not None
    inputs = trl_inputs(batch, trainer.processing_class.pad_token_id)  # type: ignore[union-attr]
    model.train()
    loss = trainer.compute_loss(model, inputs)
    opt.zero_grad()
    loss.backward()
    if trainer.args.max_grad_norm > 0:  # as transformers' training loop does
        torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
    opt.step()
    model.eval()
    metrics = trainer._metrics["train"]  # what TRL logs of the step: the clipped share of the tokens among them
    clipped = metrics.get("clip_ratio/region_mean") or metrics.get("cispo_clip_ratio") or [0.0]
    seq_gap = max((abs(sum(b) - sum(t.logprobs)) for b, t in zip(before, batch.trajectories, strict=True)), default=0.0)
    stats = SimpleNamespace(
        loss=float(loss.detach()),
        reward_mean=statistics.fmean(batch.rewards),
        max_seq_ratio=float(torch.exp(torch.tensor(seq_gap))),
        clipped_frac=float(clipped[-1]),
    )
    metrics.clear()
    return stats


def train(
    redis_url: str,
    run_id: str,
    *,
    name: str,
    loss_type: str,
    lr: float,
    clip: float,
    max_grad_norm: float,
    connect_timeout_s: float,
) -> int:
    with (
        TrainerClient.connect(redis_url, run_id, name=name, timeout_s=connect_timeout_s) as client,
        tempfile.TemporaryDirectory(prefix="rolledger-trl-") as workdir,
    ):
        trainer = build_trainer(
            str(client.model_dir), workdir, loss_type=loss_type, lr=lr, clip=clip, max_grad_norm=max_grad_norm
        )
        model = trainer.model
        assert model is not None
        torch.manual_seed(0)
        model.eval()
        restored = client.restore()
        restored.load_into(model)
        print(f"{name}: connected to {run_id}, weights v{restored.version}, TRL loss {loss_type}", flush=True)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        while (batch := client.next_batch(policy_weights(model))) is not None:
            before = token_logprobs(model, batch.trajectories)
            client.agreement(batch, [before[i] for i in batch.on_policy])
            started = time.perf_counter()
            stats = trl_step(trainer, opt, batch, before)
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
    ap.add_argument("--name", default="trl-example-trainer", help="this trainer's producer name in the log")
    ap.add_argument("--loss-type", default="dapo", help="GRPOConfig.loss_type (TRL's default: dapo)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--clip", type=float, default=0.2, help="GRPOConfig.epsilon")
    ap.add_argument(
        "--max-grad-norm", type=float, default=0.0, help="GRPOConfig.max_grad_norm; 0 (the default here): no clipping"
    )
    ap.add_argument("--connect-timeout", type=float, default=600.0, help="seconds to wait for the run to start")
    args = ap.parse_args(argv)
    return train(
        args.redis,
        args.run_id,
        name=args.name,
        loss_type=args.loss_type,
        lr=args.lr,
        clip=args.clip,
        max_grad_norm=args.max_grad_norm,
        connect_timeout_s=args.connect_timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
