"""The verifiable task: two-operand addition ("23+19=" -> "42"), its prompts, its checker and its warm-start data.

Owns prompt generation (deterministic per seed), the reward function, the supervised examples, and a calculator
tool an episode of the task may call (`calculator_env`, issue 40). Nothing here
knows about tokens: the policy's tokenizer turns text into ids.

Reward (`score`): the completion's answer is the run of digits at its start (after leading spaces), ended by
<eos>, whitespace or anything else that is not a digit.
- exact match of that number with the answer: 1.0;
- otherwise a shaped partial credit so a group of mostly-wrong samples still has reward variance RL can move:
  `partial_credit * (digits equal at the same position, aligned from the right, i.e. ones with ones) /
  max(len(predicted), len(answer))`. With the default partial_credit=0.5 a wrong answer scores at most 0.25 for a
  two-digit answer with one right digit, always strictly below an exact answer;
- no digits at all: 0.0.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rolledger.schemas.config import TaskConfig
from rolledger.schemas.episode import EnvHistory, EnvReply

EOS_TEXT = "<eos>"


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str  # e.g. "23+19="
    answer: str  # e.g. "42"
    # the source row's columns (a JSONL line, a dataset row), passed to reward functions by name; addition: answer
    columns: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SupervisedExample:
    prompt: str  # "23+19="
    completion: str  # "42" (the trainer appends <eos>)


def _pair(rng: random.Random, max_operand: int) -> tuple[int, int]:
    return rng.randint(0, max_operand), rng.randint(0, max_operand)


def make_prompts(cfg: TaskConfig, seed: int) -> list[Prompt]:
    """`cfg.num_prompts` addition problems with operands in [0, cfg.max_operand], deterministic for a seed."""
    if cfg.kind != "addition":
        raise ValueError(f"task.kind {cfg.kind!r} is not supported (only 'addition')")
    rng = random.Random(f"prompts:{seed}")
    prompts = []
    for i in range(cfg.num_prompts):
        a, b = _pair(rng, cfg.max_operand)
        text, answer = f"{a}+{b}=", str(a + b)
        prompts.append(Prompt(prompt_id=f"add-{seed}-{i}", text=text, answer=answer, columns={"answer": answer}))
    return prompts


def supervised_examples(cfg: TaskConfig, seed: int, count: int) -> list[SupervisedExample]:
    """`count` (prompt, exact answer) pairs for the warm start, drawn with their own seed stream."""
    if count < 1:
        raise ValueError(f"count must be >= 1 (got {count})")
    rng = random.Random(f"supervised:{seed}")
    out = []
    for _ in range(count):
        a, b = _pair(rng, cfg.max_operand)
        out.append(SupervisedExample(prompt=f"{a}+{b}=", completion=str(a + b)))
    return out


def parse_answer(completion_text: str) -> str:
    """The leading run of digits of a completion (after leading spaces), '' when there is none."""
    text = completion_text.split(EOS_TEXT, 1)[0].lstrip(" ")
    digits = []
    for ch in text:
        if not ch.isdigit():
            break
        digits.append(ch)
    return "".join(digits)


def score(completion_text: str, answer: str, *, partial_credit: float = 0.5) -> float:
    """1.0 for the exact answer, a shaped partial credit (< 1) for right digits in the right place, else 0.0."""
    if not answer or not answer.isdigit():
        raise ValueError(f"answer must be a non-empty string of digits (got {answer!r})")
    if not 0.0 <= partial_credit < 1.0:
        raise ValueError(f"partial_credit must be in [0, 1) (got {partial_credit})")
    predicted = parse_answer(completion_text)
    if not predicted:
        return 0.0
    if predicted == answer:
        return 1.0
    if partial_credit == 0.0:
        return 0.0
    right = sum(1 for p, a in zip(reversed(predicted), reversed(answer)) if p == a)
    return partial_credit * right / max(len(predicted), len(answer))


def addition_reward(completions: Sequence[str], answer: Sequence[str], **_: Any) -> list[float]:
    """`score` as a reward function (`rolledger.workers.policy.tasks:addition_reward`, the addition task's default):
    TRL's shape, a batch of completions and the rows' `answer` column in, one float per completion out."""
    return [score(c, str(a)) for c, a in zip(completions, answer, strict=True)]


_CALL = re.compile(r"\s*(\d+)\+(\d+)\s*")


def calculator_env(history: EnvHistory) -> EnvReply:
    """A calculator tool for the addition task (`rolledger.workers.policy.tasks:calculator_env`, task.env): a policy
    turn that is a sum, `a+b`, is a call, answered with `=<a+b>`; any other turn is the policy's answer, which ends
    the episode (scored, as every episode, on the policy's last turn). One call per episode: after its answer, the
    policy's next turn ends it whatever it is."""
    called = any(t.source == "env" for t in history.turns)
    m = _CALL.fullmatch(history.last.text)
    if m is None or called:
        return EnvReply(done=True)
    return EnvReply(text=f"={int(m.group(1)) + int(m.group(2))}")
