"""Reward functions by import path: resolving them before a run starts, calling them TRL-style, combining them by
weight, and turning every way one can misbehave into a reason naming it (never a crash, never a silent zero).

A reward function is `fn(completions: list[str], *, prompts: list[str], <column>: list[Any], ...) -> list[float]`:
the completions of a batch, the prompt texts, and every column of the prompts' rows (a column a row lacks is None;
the prompt column itself travels as `prompts`), one float per completion back. Several are summed by their weight.

`resolve(cfg)`: imports each `task.rewards[i].fn` (or the task's default); a bad path is a `RewardRefused` naming
the field and what failed (module not found, no such attribute, not callable), raised before anything starts.
`Rewards.score(completions, prompts)`: per completion, its weighted sum or the reason it could not be scored. A batch
call that raises or returns the wrong number of values is retried one completion at a time, so one bad row fails
its own sample only; a value that is not a finite real number (NaN, inf, None, a string, a bool) fails that
completion. Each reason starts `reward function 'module:function'`.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rolledger.schemas.config import TaskConfig
from rolledger.workers.policy.task_plugins import reward_paths
from rolledger.workers.policy.tasks import Prompt

RESERVED = ("completions", "prompts")  # keyword names the call itself fills; a column so named is not passed


class RewardRefused(ValueError):
    """A reward function that cannot be used: one line naming the config field and what failed."""


@dataclass(frozen=True)
class RewardFn:
    path: str  # "module:function"
    weight: float
    fn: Callable[..., Any]


def import_reward(field: str, path: str) -> Callable[..., Any]:
    """The callable at `module:attr.attr`; a RewardRefused naming `field` otherwise."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise RewardRefused(f"{field}: {path!r} is not 'module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):  # the module itself (or its package) is absent
            raise RewardRefused(f"{field}: {path!r}: module {module_name!r} not found") from None
        raise RewardRefused(f"{field}: {path!r}: importing {module_name!r} failed: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - user code may raise anything at import
        raise RewardRefused(
            f"{field}: {path!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardRefused(f"{field}: {path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardRefused(f"{field}: {path!r} is not callable (it is a {type(obj).__name__})")
    return obj  # type: ignore[no-any-return]


def resolve(cfg: TaskConfig) -> Rewards:
    """The task's reward functions, imported; a RewardRefused for the first that cannot be."""
    return Rewards([RewardFn(path, weight, import_reward(field, path)) for field, path, weight in reward_paths(cfg)])


def _value_problem(v: Any) -> str | None:
    """Why `v` is not a usable reward, None when it is one."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return f"returned {v!r} ({type(v).__name__}), not a number"
    if not math.isfinite(float(v)):
        return f"returned {float(v)}"
    return None


class Rewards:
    """The reward functions of a run, called on batches of completions."""

    def __init__(self, fns: Sequence[RewardFn]) -> None:
        self.fns = list(fns)

    def score(self, completions: Sequence[str], prompts: Sequence[Prompt]) -> list[float | str]:
        """Per completion (of the prompt at the same position): the weighted sum, or why it could not be scored."""
        n = len(completions)
        totals: list[float | str] = [0.0] * n
        for f in self.fns:
            for i, got in enumerate(self._call(f, list(completions), list(prompts))):
                current = totals[i]
                if isinstance(current, str):
                    continue  # the first reason stands
                if isinstance(got, str):
                    totals[i] = f"reward function {f.path!r} {got}"
                    continue
                total = current + f.weight * got
                totals[i] = total if math.isfinite(total) else f"reward function {f.path!r} weighted sum is {total}"
        return totals

    def _call(self, f: RewardFn, completions: list[str], prompts: list[Prompt]) -> list[float | str]:
        """One value or reason per completion: the whole batch in one call, else one call per completion."""
        got = self._call_once(f, completions, prompts)
        if isinstance(got, str) and len(completions) > 1:
            out: list[float | str] = []
            for c, p in zip(completions, prompts, strict=True):
                one = self._call_once(f, [c], [p])
                out.append(one if isinstance(one, str) else one[0])
            return out
        return [got] * len(completions) if isinstance(got, str) else got

    @staticmethod
    def _call_once(f: RewardFn, completions: list[str], prompts: list[Prompt]) -> str | list[float | str]:
        """A reason for the whole call (it raised, or returned the wrong number of values), else per-value results."""
        names = sorted({k for p in prompts for k in p.columns} - set(RESERVED))
        columns = {k: [p.columns.get(k) for p in prompts] for k in names}
        try:
            out = f.fn(completions, prompts=[p.text for p in prompts], **columns)
        except Exception as exc:  # noqa: BLE001 - a user's function may raise anything: the sample fails, not us
            return f"raised {type(exc).__name__}: {exc}"
        if hasattr(out, "tolist"):  # a numpy array or a torch tensor
            out = out.tolist()
        if not isinstance(out, list | tuple):
            return f"returned a {type(out).__name__}, not a list of floats"
        values = list(out)
        if len(values) != len(completions):
            return f"returned {len(values)} values for {len(completions)} completions"
        results: list[float | str] = []
        for v in values:
            problem = _value_problem(v)
            results.append(problem if problem is not None else float(v))
        return results
