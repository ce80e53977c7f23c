"""Which prompts are admitted next: FIFO by group identity, or shortest-remaining-group-first (SRGF).

Remaining tokens are an estimate (prompt-specific expected completion length times the samples still to finish),
reported as telemetry; they order the queue under SRGF and nothing else depends on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rolledger.workflows.state import GroupState


@dataclass(frozen=True)
class PromptItem:
    """One prompt of the run's dataset, tokenised, with the expected length of one completion."""

    index: int  # position in the run's prompt sequence: the group identity order
    prompt_id: str
    token_ids: tuple[int, ...]
    answer: str
    est_completion_tokens: int


def order_candidates(candidates: Sequence[PromptItem], policy: Literal["fifo", "srgf"], n: int) -> list[PromptItem]:
    """FIFO: by index. SRGF: by estimated group tokens (n x expected completion), ties by index."""
    if policy == "fifo":
        return sorted(candidates, key=lambda p: p.index)
    return sorted(candidates, key=lambda p: (p.est_completion_tokens * n, p.index))


def remaining_tokens(group: GroupState, est_completion_tokens: int) -> int:
    """Estimated tokens a group still has to generate: unfinished samples times the per-sample estimate."""
    if not group.status.is_open:
        return 0
    done = sum(1 for s in group.samples.values() if s.status.is_terminal)
    return max(group.n - done, 0) * est_completion_tokens
