"""The distribution an engine samples from, as log-probabilities: shared by the torch engine (which samples from it
and reports processed logprobs) and the trainer (which recomputes processed logprobs to check the engine's), so
both sides apply temperature, top-k and top-p the same way."""

from __future__ import annotations

import torch

from rolledger.schemas.config import SamplingParams


def processed_log_softmax(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution the engine samples from (temperature, then top-k, then top-p), over the
    last dimension of `logits` of any shape. Greedy (temperature 0) puts all mass on the argmax. The trainer uses
    the same function to recompute processed logprobs, so the two agree to float rounding on the same weights."""
    if sampling.temperature == 0.0:
        top = logits.argmax(dim=-1, keepdim=True)
        return torch.full_like(logits, float("-inf")).scatter(-1, top, 0.0)
    x = logits / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < x.shape[-1]:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        sorted_x = sorted_x.masked_fill(before >= sampling.top_p, float("-inf"))  # the top token always stays
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    return torch.log_softmax(x, dim=-1)
