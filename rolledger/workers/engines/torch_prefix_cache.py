"""The torch engine's prefix cache: an LRU of prompt token tuple -> batch-1 KV + the logits after the prompt.

Prefix accounting: for a group of n samples over a prompt of L tokens, prefill_tokens_computed is what actually ran
through the model and prefill_tokens_saved = n*L - computed (what a per-sample prefill would have cost beyond it).
With the prefix cache the prompt is prefilled once at batch 1 and its KV expanded to n (workers.engines.torch_decode);
this cache serves the longest common prefix with any cached prompt (its KV sliced), so only the tail is computed,
and nothing at all on an exact hit. Entries are never mutated; the engine clears the cache whenever the weights that
produced it change or go to sleep, and counts what it holds in its accounted memory (`nbytes`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values)


@dataclass
class PrefixEntry:
    kv: KV  # per layer (keys, values), batch 1, never mutated
    last_logits: torch.Tensor  # [vocab] float32, the logits after the prompt's last token
    nbytes: int


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def entry_bytes(kv: KV, last: torch.Tensor) -> int:
    """Bytes an entry of `kv` and `last` logits holds."""
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv) + (
        last.numel() * last.element_size()
    )


class PrefixCache:
    """An LRU of at most `capacity` prompts. Not thread-safe: the engine's model lock guards every use."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"prefix_cache_entries must be >= 1 (got {capacity})")
        self._capacity = capacity
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: tuple[int, ...]) -> tuple[KV | None, int, torch.Tensor | None]:
        """The cached KV sharing the longest common prefix with `key`: (kv sliced to it, its length, last logits).

        The last logits come back only on an exact hit; otherwise at least the prompt's last token is recomputed.
        """
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return hit.kv, len(key), hit.last_logits
        best_key: tuple[int, ...] | None = None
        best = 0
        for cached in self._entries:
            m = common_prefix_len(cached, key)
            if m > best:
                best_key, best = cached, m
        best = min(best, len(key) - 1)  # the logits after the last prompt token must be computed
        if best_key is None or best < 1:
            return None, 0, None
        self._entries.move_to_end(best_key)
        kv = [(k[:, :, :best], v[:, :, :best]) for k, v in self._entries[best_key].kv]
        return kv, best, None

    def store(self, key: tuple[int, ...], entry: PrefixEntry) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def nbytes(self) -> int:
        """Bytes of KV and logits held by every entry."""
        return sum(e.nbytes for e in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()
