"""Reward functions for tests/test_task_plugins.py, given to runs by import path (`plugins_for_tests:NAME`; tests/
is on pytest's path): a well-behaved one that uses a row's extra column, a constant to weigh against it, and ones
that misbehave in each way a reward function can (raise, NaN, the wrong count, a non-number) on the rows marked so."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rolledger.workers.policy.tasks import parse_answer

NOT_CALLABLE = 3  # `plugins_for_tests:NOT_CALLABLE` is not a function


def exact_times_scale(
    completions: Sequence[str], prompts: Sequence[str], answer: Sequence[str], scale: Sequence[float], **_: Any
) -> list[float]:
    """`scale` (a JSONL column) for the exact answer, else a tenth of a point per digit given; checks it was given the
    prompts alongside."""
    assert len(prompts) == len(completions) and all(p.endswith("=") for p in prompts), prompts
    out = []
    for c, a, s in zip(completions, answer, scale, strict=True):
        got = parse_answer(c)
        out.append(float(s) if got == a else 0.1 * len(got))
    return out


def constant_two(completions: Sequence[str], **_: Any) -> list[float]:
    return [2.0] * len(completions)


def misbehaves(completions: Sequence[str], mode: Sequence[str | None], **_: Any) -> list[Any]:
    """1.0 for rows whose `mode` is "ok"; a row marked "raise", "nan", "count" or "string" makes the call raise,
    return NaN for it, return one value too few, or return a string for it."""
    if "raise" in mode:
        raise ValueError("this row is poisoned")
    out: list[Any] = []
    for m in mode:
        out.append(float("nan") if m == "nan" else "oops" if m == "string" else 1.0)
    return out[:-1] if "count" in mode else out


def always_raises(completions: Sequence[str], **_: Any) -> list[float]:
    raise RuntimeError("the reward service is down")
