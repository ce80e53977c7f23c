"""Task plug-ins: where a run's prompts come from, and how a prompt's text becomes the token ids the engines see.

A plug-in is a `PromptSource`, `(cfg: TaskConfig, seed: int) -> list[Prompt]`, registered under a `task.kind` in
`SOURCES`; it must be deterministic for a config and a seed: the coordinator (which admits the prompts) and the reward
worker (which looks up a sample's row by its prompt id) each load the prompts and must agree. Built in:
- `addition` (the default): workers/policy/tasks.py's generated problems, rewarded by `tasks:addition_reward` unless
  `task.rewards` says otherwise;
- `jsonl`: one JSON object per line of `task.path` (blank lines skipped);
- `dataset`: `datasets.load_dataset(task.path, data_files=task.data_files, split=task.split)` with
  `HF_DATASETS_OFFLINE=1`, so only local files are read; refused in one line when `datasets` is not installed.
A row becomes a Prompt: its text is `row[task.prompt_field]` (a non-empty string), its answer `row[task.answer_field]`
as a string ('' when the row has none), its id `row[task.id_field]` when that is set, else `<kind>-<row number>`
(the line's number among the file's rows, from 0: stable while the file is), and the whole row travels as `columns`
to the reward functions. A task that cannot be loaded is a `TaskRefused`: one line naming the file and the row.

`prompt_token_ids(tokenizer, text)`: a tokenizer with a chat template gets the text as one user message (with the
generation prompt); one without (the project's own) tokenizes the text as it is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rolledger.schemas.config import TaskConfig
from rolledger.workers.policy.tasks import Prompt, make_prompts

PromptSource = Callable[[TaskConfig, int], list[Prompt]]

DEFAULT_REWARDS: dict[str, str] = {"addition": "rolledger.workers.policy.tasks:addition_reward"}


class TaskRefused(ValueError):
    """A task whose prompts cannot be loaded: one line naming the source and what is wrong."""


def _rows_to_prompts(cfg: TaskConfig, rows: Iterable[Mapping[str, Any]], source: str) -> list[Prompt]:
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        text = row.get(cfg.prompt_field)
        if not isinstance(text, str) or not text:
            raise TaskRefused(f"{source}: row {i} has no text in task.prompt_field {cfg.prompt_field!r}")
        answer = row.get(cfg.answer_field)
        if cfg.id_field is not None:
            if row.get(cfg.id_field) is None:
                raise TaskRefused(f"{source}: row {i} has no task.id_field {cfg.id_field!r}")
            prompt_id = str(row[cfg.id_field])
            if "@" in prompt_id:  # admission marks a prompt's later epochs with "@<epoch>"
                raise TaskRefused(f"{source}: row {i}: the prompt id {prompt_id!r} may not contain '@'")
        else:
            prompt_id = f"{cfg.kind}-{i}"
        if prompt_id in seen:
            raise TaskRefused(f"{source}: row {i} repeats the prompt id {prompt_id!r}")
        seen.add(prompt_id)
        prompts.append(Prompt(prompt_id, text, "" if answer is None else str(answer), dict(row)))
    if not prompts:
        raise TaskRefused(f"{source}: no rows")
    return prompts


def jsonl_prompts(cfg: TaskConfig, seed: int) -> list[Prompt]:
    """The rows of the JSONL file `cfg.path`, in file order (`seed` is not used)."""
    assert cfg.path is not None  # TaskConfig requires it for this kind
    try:
        with open(cfg.path, encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except OSError as exc:
        raise TaskRefused(f"task.path {cfg.path}: cannot read it: {exc.strerror or exc}") from None
    rows: list[Mapping[str, Any]] = []
    for n, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskRefused(f"task.path {cfg.path}: line {n} is not JSON: {exc.msg}") from None
        if not isinstance(row, dict):
            raise TaskRefused(f"task.path {cfg.path}: line {n} is a {type(row).__name__}, not a JSON object")
        rows.append(row)
    return _rows_to_prompts(cfg, rows, f"task.path {cfg.path}")


def dataset_prompts(cfg: TaskConfig, seed: int) -> list[Prompt]:
    """The rows of `datasets.load_dataset(cfg.path, data_files=..., split=...)`, offline (`seed` is not used)."""
    try:
        import datasets
    except ImportError:
        raise TaskRefused("task.kind='dataset' needs the datasets package: pip install datasets") from None
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: a hub name fails instead of downloading
    data_files = list(cfg.data_files) if isinstance(cfg.data_files, tuple) else cfg.data_files
    try:
        ds = datasets.load_dataset(cfg.path, data_files=data_files, split=cfg.split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types for a path, a split or a file it cannot use
        detail = " ".join(str(exc).split())
        raise TaskRefused(f"task.path {cfg.path}: datasets could not load it: {type(exc).__name__}: {detail}") from None
    return _rows_to_prompts(cfg, iter(ds), f"task.path {cfg.path} (split {cfg.split!r})")


SOURCES: dict[str, PromptSource] = {"addition": make_prompts, "jsonl": jsonl_prompts, "dataset": dataset_prompts}


def load_prompts(cfg: TaskConfig, seed: int) -> list[Prompt]:
    """The run's prompts from the plug-in registered for `cfg.kind`."""
    source = SOURCES.get(cfg.kind)
    if source is None:
        raise TaskRefused(f"task.kind {cfg.kind!r} has no prompt source (known: {', '.join(sorted(SOURCES))})")
    return source(cfg, seed)


def reward_paths(cfg: TaskConfig) -> list[tuple[str, str, float]]:
    """(config field, `module:function`, weight) of each reward function the task is scored with."""
    if cfg.rewards:
        return [(f"task.rewards[{i}].fn", r.fn, r.weight) for i, r in enumerate(cfg.rewards)]
    default = DEFAULT_REWARDS.get(cfg.kind)
    if default is None:
        raise TaskRefused(f"task.rewards: task.kind={cfg.kind!r} has no default reward function; name one")
    return [("task.rewards", default, 1.0)]


def prompt_token_ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    """The ids the engines are given for a prompt: through the tokenizer's chat template (the text as one user
    message, then the generation prompt) when it has one, else the tokenizer on the text as it is."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return tuple(tokenizer(str(rendered), add_special_tokens=False)["input_ids"])  # the template has its own
    return tuple(tokenizer(text)["input_ids"])
