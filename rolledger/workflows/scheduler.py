"""Which prompt is admitted next, and what a group is expected to cost: pure functions over the folded state.

The queue is ordered by group identity: prompts have an index in the run's prompt sequence (the dataset cycled), and
admission chooses among the `window` lowest indices not yet admitted (the *frontier* and after it). Policies:

- `fifo`: by index.
- `youngest-cancel`: by index too; on overload the youngest open groups are cancelled (workflows/groups.py).
- `srgf` (shortest-remaining-group-first): by the estimated tokens of the group, ties by index, with a fairness
  bound: a prompt that later prompts have overtaken `admission.max_wait_rounds` x `trainer.groups_per_step` times
  is admitted before any shorter one. So every prompt is admitted after at most that many later ones: none starves.

Admission is the dispatch point: a rank takes the admitted groups in admission order, as soon as it has a free slot,
so ordering the prompts at admission orders the groups that have not started. A running group is never reordered.

The estimate needs no ground truth. A group's per-sample estimate is, in this order: the mean completion length
observed for that prompt (earlier epochs, and its own samples as they finish), the mean observed for prompts of about
its length (the same power-of-two bucket of prompt tokens: "from the prompt"), the mean over every completion
observed in the run, and before anything was observed the completion cap (`completion_cap`: `sampling.max_tokens`,
or for a task with an environment the episode's `task.max_episode_tokens`, its turns and the environment's replies
together, so an episode is estimated across its turns, not as one). The reducer keeps the observations
(`SchedulerState`, bounded); the estimate's error, per finished sample against the estimate its group was admitted
with, is telemetry (`estimate_error`), and orders nothing.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from rolledger.schemas.config import RunConfig
from rolledger.workflows.state import PROMPT_STATS_KEPT, GroupState, RunState, SchedulerState


@dataclass(frozen=True)
class PromptItem:
    """One prompt of the run's prompt sequence, tokenised. `answer` is for the reward checker only: the scheduler
    never reads it."""

    index: int  # position in the run's prompt sequence: the group identity order
    prompt_id: str
    token_ids: tuple[int, ...]
    answer: str


def dataset_prompt_id(prompt_id: str) -> str:
    """The id in the run's prompts of an admitted prompt id (later epochs append `@<epoch>`, see `prompt_at`)."""
    return prompt_id.rsplit("@", 1)[0]


def prompt_at(prompts: Sequence[PromptItem], i: int) -> PromptItem:
    """The i-th prompt of the run: the dataset cycled, later epochs with their own prompt ids."""
    base = prompts[i % len(prompts)]
    if i < len(prompts):
        return base
    return PromptItem(i, f"{base.prompt_id}@{i // len(prompts)}", base.token_ids, base.answer)


# ---------------------------------------------------------------- the estimate
def length_bucket(prompt_tokens: int) -> int:
    """Prompts of about the same length share a bucket: the bit length of their token count (1, 2-3, 4-7, ...)."""
    return prompt_tokens.bit_length()


def completion_cap(cfg: RunConfig) -> int:
    """The most tokens one sample's completion holds: `sampling.max_tokens`, or for a task with an environment the
    episode's budget (`task.max_episode_tokens`: every policy turn and environment reply together, issue 40)."""
    return cfg.task.max_episode_tokens if cfg.task.episodes else cfg.sampling.max_tokens


def est_completion_tokens(state: RunState, cfg: RunConfig, prompt_id: str, prompt_tokens: int) -> int:
    """Expected tokens of one completion of `prompt_id` (any epoch) with `prompt_tokens` tokens: its observed mean,
    else its length bucket's, else the run's, else the completion cap. Never above `completion_cap(cfg)` (for an
    episode, its whole budget across turns), never below 1."""
    sch = state.scheduler
    seen = sch.prompt_lengths.get(dataset_prompt_id(prompt_id))
    bucket = sch.bucket_lengths.get(length_bucket(prompt_tokens))
    if seen is not None and seen[0]:
        mean = seen[1] / seen[0]
    elif bucket is not None and bucket[0]:
        mean = bucket[1] / bucket[0]
    elif sch.observed_samples:
        mean = sch.observed_tokens / sch.observed_samples
    else:
        return completion_cap(cfg)
    return min(max(round(mean), 1), completion_cap(cfg))


def remaining_tokens(group: GroupState, per_sample: int) -> int:
    """Estimated tokens a group still has to generate: unfinished samples times the per-sample estimate (0 once the
    group is closed)."""
    if not group.status.is_open:
        return 0
    done = sum(1 for s in group.samples.values() if s.status.is_terminal)
    return max(group.n - done, 0) * per_sample


def group_remaining_tokens(state: RunState, cfg: RunConfig, group: GroupState) -> int:
    """`remaining_tokens` with the current estimate for the group's prompt (its finished samples included)."""
    return remaining_tokens(group, est_completion_tokens(state, cfg, group.prompt_id, group.prompt_tokens))


def observe_completion(sch: SchedulerState, group: GroupState, tokens: int) -> None:
    """The reducer's update when a sample of `group` finishes with `tokens` completion tokens: the per-prompt,
    per-bucket and run-wide means, and the error of the estimate the group was admitted with."""
    prompt_id = group.prompt_id
    key = dataset_prompt_id(prompt_id) if "@" in prompt_id else prompt_id
    lengths = sch.prompt_lengths
    seen = lengths.get(key)
    if seen is None:
        seen = lengths[key] = [0, 0]
    else:
        lengths.move_to_end(key)  # the dict is oldest-observed first
    seen[0] += 1
    seen[1] += tokens
    if len(lengths) > PROMPT_STATS_KEPT:
        lengths.popitem(last=False)
    b = length_bucket(group.prompt_tokens)
    bucket = sch.bucket_lengths.get(b)
    if bucket is None:
        bucket = sch.bucket_lengths[b] = [0, 0]
    bucket[0] += 1
    bucket[1] += tokens
    estimated = group.est_remaining_tokens // max(group.n, 1)
    sch.observed_samples += 1
    sch.observed_tokens += tokens
    sch.est_abs_error += abs(estimated - tokens)
    sch.est_signed_error += estimated - tokens


def estimate_error(sch: SchedulerState) -> tuple[float, float]:
    """(mean absolute, mean signed) error in tokens of the per-sample estimate over every finished sample; a positive
    signed error means the estimate ran long. (0, 0) before any sample finished."""
    if not sch.observed_samples:
        return 0.0, 0.0
    return sch.est_abs_error / sch.observed_samples, sch.est_signed_error / sch.observed_samples


def admit_index(sch: SchedulerState, index: int) -> None:
    """The reducer's update when the prompt at `index` is admitted: the frontier advances past every admitted index
    (`ahead` holds the admitted ones beyond it, sorted)."""
    if index < sch.frontier or index in sch.ahead:
        return
    bisect.insort(sch.ahead, index)
    while sch.ahead and sch.ahead[0] == sch.frontier:
        sch.ahead.pop(0)
        sch.frontier += 1


# ---------------------------------------------------------------- the order
def candidates(sch: SchedulerState, prompts: Sequence[PromptItem], window: int) -> list[PromptItem]:
    """The `window` lowest prompt indices not yet admitted, lowest first."""
    out: list[PromptItem] = []
    i = sch.frontier
    taken = set(sch.ahead)
    while len(out) < window:
        if i not in taken:
            out.append(prompt_at(prompts, i))
        i += 1
    return out


def overtaken(sch: SchedulerState, index: int, extra: Sequence[int] = ()) -> int:
    """How many admitted prompts come after `index` (`extra`: indices admitted in this decision, not folded yet)."""
    return len(sch.ahead) - bisect.bisect_right(sch.ahead, index) + sum(1 for j in extra if j > index)


def pick_next(
    state: RunState, cfg: RunConfig, pool: list[PromptItem], admitted_now: Sequence[int]
) -> PromptItem | None:
    """The prompt to admit next out of `pool` (the candidates not admitted in this decision yet)."""
    if not pool:
        return None
    if cfg.scheduler != "srgf":
        return min(pool, key=lambda p: p.index)
    bound = cfg.admission.max_wait_rounds * cfg.trainer.groups_per_step
    sch = state.scheduler
    due = [p for p in pool if overtaken(sch, p.index, admitted_now) >= bound]
    if due:  # the fairness bound: the oldest overdue prompt goes first, whatever it costs
        return min(due, key=lambda p: p.index)
    return min(pool, key=lambda p: (est_completion_tokens(state, cfg, p.prompt_id, len(p.token_ids)), p.index))
