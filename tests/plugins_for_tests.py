"""Plug-ins for tests, given to runs by import path (`plugins_for_tests:NAME`; tests/ is on pytest's path).

Reward functions (tests/test_task_plugins.py): a well-behaved one that uses a row's extra column, a constant to weigh
against it, and ones that misbehave in each way a reward function can (raise, NaN, the wrong count, a non-number) on
the rows marked so. Environments (task.env, tests/test_episodes*.py): well-behaved ones (text and token replies, a
guess-the-number game) and ones that raise, hang or answer garbage on one sample of each group."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from rolledger.schemas.episode import EnvHistory, EnvReply
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


# ---------------------------------------------------------------- environments (task.env, issue 40)
# Replies use the project's tokenizer's characters (digits, '+', '=', ' '). Each misbehaving one misbehaves only on
# the sample of index 1 of a group, so a test can see that only that sample fails.


def counting_env(history: EnvHistory) -> EnvReply:
    """Answers the policy's k-th turn with the text "=k"; done after the policy's third turn (its reply is kept)."""
    k = history.policy_turns
    return EnvReply(text=f"={k}", done=k >= 3, info={"turn": k})


def token_env(history: EnvHistory) -> EnvReply:
    """Answers with token ids (the tokenizer's '+' and '='), done after the policy's second turn."""
    return EnvReply(token_ids=(13, 14), done=history.policy_turns >= 2)


def guess_env(history: EnvHistory) -> EnvReply:
    """Guess the number: the group's answer is the number; done once the policy's last turn starts with it, else
    "+" (higher) or "=" (lower); dict replies are validated as EnvReply."""
    guess = parse_answer(history.last.text)
    if guess == history.answer:
        return EnvReply(done=True)
    return {"text": "+" if not guess or int(guess) < int(history.answer) else "=", "done": False}  # type: ignore[return-value]


def slow_env(history: EnvHistory) -> EnvReply:
    """counting_env as a slow tool (a quarter of a second a step): an update's drain and commit happen while
    episodes wait on it (tests/test_episodes_run.py, interruptible)."""
    time.sleep(0.25)
    return counting_env(history)


def _second_sample(history: EnvHistory) -> bool:
    return history.sample_id.endswith("/1")


def raising_env(history: EnvHistory) -> EnvReply:
    if _second_sample(history):
        raise ValueError(f"the tool crashed on {history.sample_id}")
    return counting_env(history)


def hanging_env(history: EnvHistory) -> EnvReply:
    if _second_sample(history):
        threading.Event().wait()  # never returns: the rank's timeout kills this process
    return counting_env(history)


def garbage_env(history: EnvHistory) -> Any:
    if _second_sample(history):
        return "not a reply"
    return counting_env(history)


def invalid_env(history: EnvHistory) -> Any:
    if _second_sample(history):
        return {"text": "=1", "done": "maybe"}
    return counting_env(history)
