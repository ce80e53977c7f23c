"""Batched KV-cache generation of one group over an HF causal LM: prefill (through the prefix cache), sampling, decode.

`KVDecoder.decode` runs one group of n samples of one prompt: the prompt's KV comes from the prefix cache
(workers.engines.torch_prefix_cache) or is prefilled at batch n when the cache is off, then every step samples the
next token of each unfinished sample (temperature / top-k / top-p / seed / stop ids, with raw or processed logprobs)
and feeds it back through the model. A sample that ends (stop, length, or cancelled: a first k reached) leaves the
decode batch and its KV cache rows at once, so the steps after it compute only the samples still running. Between steps it asks the engine's `poll` whether to go on (pause/abort/park
are the engine's), and re-reads the serving version so an interruptible engine stamps a new span when the weights
changed while parked. The caller holds the engine's model lock for the whole call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import xxhash
from transformers import DynamicCache

from rolledger.schemas.config import SamplingParams
from rolledger.workers.engines.protocol import HealthReport, SampleOutput
from rolledger.workers.engines.torch_prefix_cache import PrefixCache, PrefixEntry, entry_bytes
from rolledger.workers.policy.sampling import processed_log_softmax

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class Decoded:
    """A decoded group: its samples, the policy version it ended on, and its prefill accounting."""

    samples: list[SampleOutput]
    policy_version: int
    prefill_tokens_computed: int
    prefill_tokens_saved: int


def validate_request(prompt: list[int], n: int, sampling: SamplingParams, vocab_size: int, max_positions: int) -> None:
    """ValueError for a request the model cannot run: n < 1, an empty prompt, ids outside the vocabulary, too long."""
    if n < 1:
        raise ValueError(f"n must be >= 1 (got {n})")
    if not prompt:
        raise ValueError("prompt_token_ids is empty")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_token_ids holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(prompt) + sampling.max_tokens > max_positions:
        raise ValueError(
            f"sampling.max_tokens={sampling.max_tokens} with a {len(prompt)}-token prompt exceeds the model's "
            f"max_position_embeddings={max_positions}"
        )


class KVDecoder:
    """Generation over `model` (an HF causal LM on `device`); `prefix` is the prefix cache, or None to prefill at n."""

    def __init__(self, model: Any, *, device: torch.device, eos_id: int, pad_id: int, prefix: PrefixCache | None):
        self._model = model
        self.device = device
        self._eos_id = eos_id
        self._pad_id = pad_id
        self._prefix = prefix
        forward_params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward_params else "past_key_values"

    @torch.inference_mode()
    def decode(
        self,
        prompt: list[int],
        n: int,
        sampling: SamplingParams,
        *,
        serving: Callable[[], tuple[int, str]],
        poll: Callable[[int], bool],
        should_cancel: Callable[[int], bool] | None,
        on_sample: Callable[[int, SampleOutput], None] | None = None,
    ) -> Decoded:
        """Decode one group. `serving()`: the (policy version, weights digest) serving now; `poll(version)`: False
        ends the unfinished samples with "abort"."""
        version, digest = serving()
        cache, logits, computed, saved = self.prefill(prompt, n)
        gen = torch.Generator(device=self.device)
        if sampling.seed is not None:
            gen.manual_seed(sampling.seed)
        else:
            gen.seed()
        stops = set(sampling.stop_token_ids) | {self._eos_id}
        spans: list[list[tuple[int, int, str]]] = [[(0, version, digest)] for _ in range(n)]
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        finish: list[FinishReason | None] = [None] * n

        active = list(range(n))  # the samples still in the decode batch, by row (finished and cancelled ones leave it)
        for step in range(sampling.max_tokens):
            if not poll(version):
                finish = [f if f is not None else "abort" for f in finish]
                break
            now, digest = serving()
            if now != version:  # interruptible: new weights were committed while parked
                version = now
                for i in range(n):
                    if finish[i] is None:
                        spans[i].append((len(tokens[i]), version, digest))
            if should_cancel is not None:
                for i in active:
                    if finish[i] is None and should_cancel(i):
                        finish[i] = "abort"
            if all(f is not None for f in finish):
                break
            next_ids, raw_lp, proc_lp = sample(logits, sampling, gen)
            chosen = raw_lp if sampling.logprob_mode == "raw" else proc_lp
            step_ids, step_lps = next_ids.tolist(), chosen.tolist()  # one copy out, not one per row
            for row, i in enumerate(active):
                if finish[i] is not None:
                    continue
                tok = step_ids[row]
                tokens[i].append(tok)
                logprobs[i].append(step_lps[row])
                if tok in stops:
                    finish[i] = "stop"
                elif step == sampling.max_tokens - 1:
                    finish[i] = "length"
                ended = finish[i]
                if ended is not None and on_sample is not None:  # stream each sample as soon as it ends
                    on_sample(
                        i,
                        SampleOutput(
                            token_ids=list(tokens[i]),
                            logprobs=list(logprobs[i]),
                            finish_reason=ended,
                            spans=tuple(spans[i]) if len(spans[i]) > 1 else (),
                        ),
                    )
            if all(f is not None for f in finish):
                break
            keep = [row for row, i in enumerate(active) if finish[i] is None]
            if len(keep) < len(active):  # the ended rows leave the batch: the next steps compute only the others
                rows = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(rows)
                next_ids = next_ids[rows]
                active = [active[row] for row in keep]
            out = self._forward(next_ids[:, None], cache)
            cache = self.out_cache(out)
            logits = out.logits[:, -1, :].float()

        samples = [
            SampleOutput(
                token_ids=tokens[i],
                logprobs=logprobs[i],
                finish_reason=finish[i] or "length",
                spans=tuple(spans[i]) if len(spans[i]) > 1 else (),
            )
            for i in range(n)
        ]
        return Decoded(
            samples=samples, policy_version=version, prefill_tokens_computed=computed, prefill_tokens_saved=saved
        )

    @torch.inference_mode()
    def probe(self, probe_ids: list[int]) -> HealthReport:
        """Greedy 4-token decode of `probe_ids` (full forward each step); fails on NaN/inf or an error of the model."""
        h = xxhash.xxh3_128()
        try:
            ids = list(probe_ids)
            for _ in range(4):
                logits = self._model(input_ids=torch.tensor([ids], device=self.device)).logits[0, -1].float()
                if not bool(torch.isfinite(logits).all()):
                    return HealthReport(ok=False, detail=f"non-finite logits at probe position {len(ids)}")
                h.update(logits.cpu().numpy().tobytes())  # the exact logits: ranks on other weights cannot match
                ids.append(int(logits.argmax()))
        except Exception as exc:  # noqa: BLE001 - an engine error is a failed probe, not a crash of the caller
            return HealthReport(ok=False, detail=f"probe forward failed: {exc!r}")
        generated = ids[len(probe_ids) :]
        h.update(",".join(map(str, ids)).encode())
        digest = h.hexdigest()
        return HealthReport(ok=True, detail=f"probe greedy tokens {generated}", probe_digest=digest)

    def _forward(self, input_ids: torch.Tensor, cache: DynamicCache | None) -> Any:
        """One forward with a KV cache; transformers 5.x names it `cache`, older releases `past_key_values`."""
        kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": True}
        if cache is not None:
            kwargs[self._cache_kw] = cache
        return self._model(**kwargs)

    def forward_step(
        self, input_ids: torch.Tensor, cache: DynamicCache, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> Any:
        """One decode forward of a padded batch (workers.engines.torch_batch): the mask hides each row's padding
        columns and `position_ids` [rows, 1] gives each row its own position."""
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "use_cache": True,
            self._cache_kw: cache,
        }
        return self._model(**kwargs)

    @staticmethod
    def out_cache(out: Any) -> DynamicCache:
        cache = out.get("cache") if hasattr(out, "get") else None
        return cache if cache is not None else out.past_key_values

    def prefill(self, prompt: list[int], n: int) -> tuple[DynamicCache, torch.Tensor, int, int]:
        """KV cache of the prompt expanded to batch n, the next-token logits [n, vocab], computed and saved counts."""
        length = len(prompt)
        config = self._model.config
        prefix = self._prefix
        if prefix is None:
            ids = torch.tensor([prompt] * n, device=self.device)
            out = self._forward(ids, None)
            return self.out_cache(out), out.logits[:, -1, :].float(), n * length, 0

        key = tuple(prompt)
        cached_kv, matched, cached_last = prefix.lookup(key)
        if cached_kv is not None and cached_last is not None:
            computed = 0
            kv, last = cached_kv, cached_last
        else:
            base = DynamicCache(ddp_cache_data=cached_kv, config=config) if cached_kv is not None else None
            ids = torch.tensor([prompt[matched:]], device=self.device)
            out = self._forward(ids, base)
            kv = [
                (cast(torch.Tensor, layer.keys), cast(torch.Tensor, layer.values))
                for layer in cast(Any, self.out_cache(out)).layers
            ]
            last = out.logits[0, -1, :].float()
            computed = length - matched
            prefix.store(key, PrefixEntry(kv=kv, last_logits=last, nbytes=entry_bytes(kv, last)))
        expanded = [(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1)) for k, v in kv]
        cache = DynamicCache(ddp_cache_data=expanded, config=config)  # copies: the stored entry is never touched
        return cache, last.unsqueeze(0).expand(n, -1), computed, n * length - computed


def sample(
    logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next tokens [n], their raw logprobs (unmodified logits) and processed logprobs (after T/top-k/top-p)."""
    raw = torch.log_softmax(logits, dim=-1)
    if sampling.temperature == 0.0:
        chosen = logits.argmax(dim=-1)
        return chosen, raw.gather(-1, chosen[:, None])[:, 0], torch.zeros_like(chosen, dtype=raw.dtype)
    processed = processed_log_softmax(logits, sampling)
    chosen = torch.multinomial(processed.exp(), 1, generator=gen)[:, 0]
    return chosen, raw.gather(-1, chosen[:, None])[:, 0], processed.gather(-1, chosen[:, None])[:, 0]
