"""What a sample of the simulated engine (workers.engines.simulated_engine, which decides when each token is
produced) is: drawn from seeds, never computed.

- A sample's length is declared, never computed: `lengths[i % len(lengths)]` when given per sample, else lognormal
  around `length_median`: a prompt factor exp(prompt_sigma * z_p), z_p seeded by the prompt's token ids (a prompt's
  own difficulty, what a length estimate can learn), times a sample factor exp(length_sigma * z_s), z_s seeded by
  (the group's sampling seed, the sample index); rounded, at least 1, capped at `sampling.max_tokens` (finish
  "length" at the cap, else "stop" with <eos> as the last token). The same prompt and seed give the same lengths in
  every configuration of a benchmark.
- Token ids are arbitrary task characters (never <pad>/<bos>; <eos> only last) and logprobs plausible finite
  negative numbers, drawn from the seed, the index and the digest of the weights the sample started on (other
  weights serve other tokens): NOT a model's. A trainer cannot check agreement against them; a benchmark
  that goes through the trainer API must say that agreement was not measured.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Literal

import xxhash

from rolledger.schemas.config import SimulatedConfig

FinishReason = Literal["stop", "length", "abort"]
_FIRST_TOKEN = 3  # ids 0..2 are <pad>, <bos>, <eos> in the project's tokenizer (workers.policy.policy_model)


def sample_length(cfg: SimulatedConfig, prompt: Sequence[int], seed: int | None, index: int, cap: int) -> int:
    """The declared length of sample `index` of a group of `prompt` drawn with `seed` (see the module docstring)."""
    if cfg.lengths:
        return max(1, min(cap, cfg.lengths[index % len(cfg.lengths)]))
    z_prompt = 0.0
    if cfg.prompt_sigma > 0:
        h = xxhash.xxh64(",".join(map(str, prompt)).encode()).intdigest()
        z_prompt = random.Random(h).gauss(0.0, 1.0)
    z_sample = random.Random(f"{seed}/{index}").gauss(0.0, 1.0) if cfg.length_sigma > 0 else 0.0
    length = cfg.length_median * math.exp(cfg.prompt_sigma * z_prompt + cfg.length_sigma * z_sample)
    return max(1, min(cap, round(length)))


def sample_tokens(
    seed: int | None, index: int, digest: str, tokens: int, vocab: int, eos_id: int, reason: FinishReason
) -> tuple[list[int], list[float]]:
    """The first `tokens` token ids and logprobs of sample `index` of a group drawn with `seed`, started on the weights
    of `digest` (other weights serve other tokens); a sample that stopped ends with <eos>."""
    rng = random.Random(f"tokens/{seed}/{index}/{digest}")  # other weights, other tokens
    span = vocab - _FIRST_TOKEN
    ids = [_FIRST_TOKEN + rng.randrange(span) for _ in range(tokens)]
    logprobs = [-0.05 - 2.0 * rng.random() for _ in range(tokens)]
    if reason == "stop" and ids:
        ids[-1] = eos_id
    return ids, logprobs
