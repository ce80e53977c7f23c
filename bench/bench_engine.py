"""Benchmark of the torch engine: prefill work with the shared prefix cache vs without, and decode throughput.

Workload: `--groups` groups of `--n` samples on the tiny policy (default ModelConfig, positions widened for the
prompt), each prompt "<few-shot prefix> a+b=" where the few-shot prefix (`--fewshot` solved examples) is shared by all
prompts, the way a system prompt is. Run side by side in one process on the same weights:

  no-cache    TorchEngine(prefix_cache=False): the prompt is prefilled for each of the n samples
  cache       TorchEngine(prefix_cache=True): prompt prefilled once per group, and only the tail past the longest
              cached prefix (the shared few-shot part is reused across groups)
  cache-rep   the same engine on the same prompts again (exact hits: nothing prefilled) - what a second pass over a
              prompt pool costs while the policy version is unchanged
  hf-generate baseline: transformers' model.generate(do_sample, num_return_sequences=n) on the same prompts

    python bench/bench_engine.py [--groups 32] [--n 8] [--max-tokens 8] [--fewshot 6] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from transformers import Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rolledger.schemas.config import ModelConfig, SamplingParams
from rolledger.workers.engines.torch_engine import TorchEngine
from rolledger.workers.policy.policy_model import build_model, build_tokenizer


@dataclass
class Row:
    name: str
    prefill_computed: float  # per group
    prefill_saved: float  # per group
    gen_tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.gen_tokens / self.seconds if self.seconds > 0 else 0.0


def make_prompts(groups: int, fewshot: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    shots = []
    for _ in range(fewshot):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        shots.append(f"{a}+{b}={a + b} ")
    prefix = "".join(shots)
    out = []
    for _ in range(groups):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        out.append(f"{prefix}{a}+{b}=")
    return out


def run_engine(name: str, engine: TorchEngine, prompts: list[list[int]], n: int, sp: SamplingParams) -> Row:
    computed = saved = tokens = 0
    start = time.perf_counter()
    for g, ids in enumerate(prompts):
        out = engine.generate(ids, n, sp.model_copy(update={"seed": g}))
        computed += out.prefill_tokens_computed
        saved += out.prefill_tokens_saved
        tokens += sum(len(s.token_ids) for s in out.samples)
    return Row(name, computed / len(prompts), saved / len(prompts), tokens, time.perf_counter() - start)


def run_hf(model: Qwen2ForCausalLM, eos: int, pad: int, prompts: list[list[int]], n: int, max_tokens: int) -> Row:
    tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for g, ids in enumerate(prompts):
            torch.manual_seed(g)
            out = model.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=True,
                top_k=0,
                temperature=1.0,
                max_new_tokens=max_tokens,
                num_return_sequences=n,
                eos_token_id=eos,
                pad_token_id=pad,
            )
            for row in out[:, len(ids) :].tolist():
                tokens += next((k + 1 for k, t in enumerate(row) if t == eos), len(row))
    per_group = sum(len(p) for p in prompts) * n / len(prompts)
    return Row("hf-generate", per_group, 0, tokens, time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--fewshot", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tok = build_tokenizer()
    texts = make_prompts(args.groups, args.fewshot, args.seed)
    prompts = [list(tok(t)["input_ids"]) for t in texts]
    cfg = ModelConfig(max_position_embeddings=max(64, max(map(len, prompts)) + args.max_tokens))
    sp = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)

    def fresh() -> Qwen2ForCausalLM:
        return cast(Qwen2ForCausalLM, build_model(cfg, len(tok), args.seed))  # the default architecture

    plain = TorchEngine(fresh(), tok, prefix_cache=False)
    cached = TorchEngine(fresh(), tok, prefix_cache=True)
    run_engine("warmup", TorchEngine(fresh(), tok), prompts[:2], args.n, sp)
    rows = [
        run_engine("no-cache", plain, prompts, args.n, sp),
        run_engine("cache", cached, prompts, args.n, sp),
        run_engine("cache-rep", cached, prompts, args.n, sp),
        run_hf(fresh(), tok.eos_token_id, tok.pad_token_id, prompts, args.n, args.max_tokens),
    ]
    base = rows[0]
    print(
        f"groups={args.groups} n={args.n} prompt_tokens~{sum(map(len, prompts)) / len(prompts):.1f} "
        f"max_tokens={args.max_tokens} threads={args.threads}"
    )
    print(
        f"{'mode':<12} {'prefill/group':>14} {'saved/group':>12} {'vs no-cache':>12} {'gen tok/s':>10} {'vs no-cache':>12}"
    )
    for r in rows:
        ratio = r.prefill_computed / base.prefill_computed if base.prefill_computed else 0.0
        speed = r.tok_s / base.tok_s if base.tok_s else 0.0
        print(
            f"{r.name:<12} {r.prefill_computed:>14.1f} {r.prefill_saved:>12.1f} {ratio:>11.3f}x "
            f"{r.tok_s:>10.0f} {speed:>11.2f}x"
        )


if __name__ == "__main__":
    main()
