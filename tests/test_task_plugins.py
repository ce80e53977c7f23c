"""Tasks, datasets and rewards as plug-ins: prompts from a JSONL file or a `datasets` dataset on local files, reward
functions by import path combined by weight, a misbehaving reward function failing its samples (never the worker,
never a silent zero), and the chat template when the tokenizer has one. The end-to-end cases run the real loop
(real Redis, the real torch policy) with the functions of tests/plugins_for_tests.py."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import plugins_for_tests as plugins
import pytest
from test_run_loop import execute, small

from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig, TaskConfig
from rolledger.schemas.statuses import RunStatus
from rolledger.workers.operator.local_run import prompt_items
from rolledger.workers.policy.policy_model import build_tokenizer
from rolledger.workers.policy.rewards import RewardFn, RewardRefused, Rewards, import_reward, resolve
from rolledger.workers.policy.run_inputs import RunRefused, check_task
from rolledger.workers.policy.task_plugins import TaskRefused, load_prompts, prompt_token_ids
from rolledger.workers.policy.tasks import Prompt
from rolledger.workflows.audit import audit
from rolledger.workflows.scheduler import dataset_prompt_id

ROWS = [("12+7=", "19"), ("3+4=", "7"), ("20+5=", "25"), ("8+8=", "16"), ("31+2=", "33"), ("6+0=", "6")]


def write_jsonl(path: Path, rows: Sequence[Mapping[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def jsonl_task(path: Path, *rewards: tuple[str, float], **extra: object) -> dict[str, object]:
    return {"kind": "jsonl", "path": str(path), "rewards": [{"fn": f, "weight": w} for f, w in rewards], **extra}


def finished_texts(events: list[ev.Event]) -> dict[str, tuple[str, str]]:
    """sample id -> (its completion up to <eos>, its prompt id), decoded as the reward worker does."""
    tok = build_tokenizer()
    out = {}
    for e in events:
        if isinstance(e.payload, ev.SampleFinished):
            ids = list(e.payload.trajectory.token_ids)
            ids = ids[: ids.index(tok.eos_token_id)] if tok.eos_token_id in ids else ids
            out[e.payload.trajectory.trajectory_id] = (
                str(tok.decode(ids, skip_special_tokens=True)),
                dataset_prompt_id(e.payload.trajectory.prompt_id),
            )
    return out


# ---------------------------------------------------------------- prompts


def test_jsonl_rows_become_prompts_with_stable_ids_and_their_columns(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "t.jsonl", [{"prompt": p, "answer": a, "extra": i} for i, (p, a) in enumerate(ROWS)])
    f.write_text(f.read_text().replace("\n", "\n\n", 1))  # a blank line is skipped, not a row
    cfg = TaskConfig.model_validate(jsonl_task(f, ("plugins_for_tests:constant_two", 1.0)))
    prompts = load_prompts(cfg, seed=0)
    assert [(p.prompt_id, p.text, p.answer) for p in prompts] == [(f"jsonl-{i}", p, a) for i, (p, a) in enumerate(ROWS)]
    assert prompts[2].columns == {"prompt": "20+5=", "answer": "25", "extra": 2}
    assert load_prompts(cfg, seed=7) == prompts  # the file, not the seed, decides

    named = write_jsonl(tmp_path / "n.jsonl", [{"q": "1+1=", "a": 2, "uid": "x1"}, {"q": "2+2=", "uid": "x2"}])
    cfg2 = cfg.model_copy(update={"path": str(named), "prompt_field": "q", "answer_field": "a", "id_field": "uid"})
    assert [(p.prompt_id, p.text, p.answer) for p in load_prompts(cfg2, 0)] == [("x1", "1+1=", "2"), ("x2", "2+2=", "")]


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ('{"prompt": "1+1="}\nnot json\n', "line 2 is not JSON"),
        ('{"prompt": "1+1="}\n[1, 2]\n', "line 2 is a list, not a JSON object"),
        ('{"question": "1+1="}\n', "row 0 has no text in task.prompt_field 'prompt'"),
        ("\n", "no rows"),
    ],
)
def test_a_jsonl_file_that_cannot_be_used_is_one_line(tmp_path: Path, content: str, why: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    cfg = RunConfig.model_validate({"task": jsonl_task(f, ("plugins_for_tests:constant_two", 1.0))})
    with pytest.raises(RunRefused) as info:
        check_task(cfg)
    assert why in str(info.value) and str(f) in str(info.value) and "\n" not in str(info.value)


def test_a_dataset_on_local_files_and_the_refusal_without_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("datasets")
    data = write_jsonl(tmp_path / "d.json", [{"question": p, "answer": a} for p, a in ROWS])
    cfg = TaskConfig.model_validate(
        {
            "kind": "dataset",
            "path": "json",
            "data_files": [str(data)],
            "prompt_field": "question",
            "rewards": [{"fn": "plugins_for_tests:constant_two"}],
        }
    )
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    prompts = load_prompts(cfg, 0)
    assert [(p.prompt_id, p.text, p.answer) for p in prompts] == [
        (f"dataset-{i}", p, a) for i, (p, a) in enumerate(ROWS)
    ]
    with pytest.raises(TaskRefused, match="datasets could not load it"):
        load_prompts(cfg.model_copy(update={"split": "nope"}), 0)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed
    with pytest.raises(TaskRefused, match=r"^task.kind='dataset' needs the datasets package: pip install datasets$"):
        load_prompts(cfg, 0)


def test_the_chat_template_wraps_the_prompt_as_a_user_message_when_there_is_one() -> None:
    tok = build_tokenizer()
    assert not getattr(tok, "chat_template", None)
    plain = prompt_items(small(), tok)
    assert all(
        item.token_ids == tuple(tok(p.text)["input_ids"]) for item, p in zip(plain, load_prompts(small().task, 0))
    )
    # a template in the tokenizer's characters: "<bos> <user text> =" (the generation prompt is the "=")
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    assert prompt_token_ids(tok, "12+7") == tuple(tok("12+7=")["input_ids"])
    assert tok.convert_ids_to_tokens(list(prompt_token_ids(tok, "3+4"))) == ["<bos>", "3", "+", "4", "="]


# ---------------------------------------------------------------- reward functions


def _prompts(*modes: str) -> list[Prompt]:
    return [Prompt(f"p{i}", "1+1=", "2", {"prompt": "1+1=", "answer": "2", "mode": m}) for i, m in enumerate(modes)]


def test_reward_functions_combine_by_weight_and_the_builtin_is_one_of_them() -> None:
    builtin = import_reward("task.rewards[0].fn", "rolledger.workers.policy.tasks:addition_reward")
    rewards = Rewards(
        [
            RewardFn("rolledger.workers.policy.tasks:addition_reward", 2.0, builtin),
            RewardFn("c2", -0.25, plugins.constant_two),
        ]
    )
    assert rewards.score(["2<eos>", "3", "", "12"], _prompts("ok", "ok", "ok", "ok")) == [1.5, -0.5, -0.5, 0.0]
    default = resolve(TaskConfig())  # the addition task without `rewards`: its checker, weight 1
    assert [(f.path, f.weight) for f in default.fns] == [("rolledger.workers.policy.tasks:addition_reward", 1.0)]


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("raise", "raised ValueError: this row is poisoned"),
        ("nan", "returned nan"),
        ("count", "returned 0 values for 1 completions"),
        ("string", "returned 'oops' (str), not a number"),
    ],
)
def test_a_misbehaving_reward_function_fails_only_its_own_completion(mode: str, reason: str) -> None:
    rewards = Rewards([RewardFn("plugins_for_tests:misbehaves", 1.0, plugins.misbehaves)])
    got = rewards.score(["2", "2", "2"], _prompts("ok", mode, "ok"))
    assert got == [1.0, f"reward function 'plugins_for_tests:misbehaves' {reason}", 1.0]


def test_a_bad_import_path_is_refused_naming_the_field() -> None:
    for path, why in [
        ("no_such_module_xyz:f", "module 'no_such_module_xyz' not found"),
        ("plugins_for_tests:nope", "module 'plugins_for_tests' has no attribute 'nope'"),
        ("plugins_for_tests:NOT_CALLABLE", "'plugins_for_tests:NOT_CALLABLE' is not callable (it is a int)"),
    ]:
        cfg = TaskConfig(rewards=({"fn": "math:fsum"}, {"fn": path}))  # type: ignore[arg-type]
        with pytest.raises(RewardRefused) as info:
            resolve(cfg)
        assert str(info.value).startswith("task.rewards[1].fn: ") and why in str(info.value), str(info.value)


# ---------------------------------------------------------------- through the real loop


@pytest.mark.slow
def test_a_jsonl_task_with_weighted_user_rewards_runs_end_to_end(redis_url: str, tmp_path: Path) -> None:
    rows = [{"prompt": p, "answer": a, "scale": 2.0 + i} for i, (p, a) in enumerate(ROWS)]
    f = write_jsonl(tmp_path / "t.jsonl", rows)
    task = jsonl_task(f, ("plugins_for_tests:exact_times_scale", 1.0), ("plugins_for_tests:constant_two", 0.5))
    events, summary = execute(redis_url, "jsonl-e2e", tmp_path, small(task=task))
    assert summary.status == RunStatus.COMPLETED and audit(events).ok
    admitted = {dataset_prompt_id(e.payload.prompt_id) for e in events if isinstance(e.payload, ev.GroupAdmitted)}
    assert admitted <= {f"jsonl-{i}" for i in range(len(ROWS))} and len(admitted) >= 3
    texts = finished_texts(events)
    scored = [e.payload for e in events if isinstance(e.payload, ev.SampleScored)]
    assert len(scored) >= 3 * 2 * 4  # 3 steps of 2 groups of 4
    by_id = {f"jsonl-{i}": r for i, r in enumerate(rows)}
    for s in scored:
        text, pid = texts[s.sample_id]
        row = by_id[pid]
        [mine] = plugins.exact_times_scale([text], [str(row["prompt"])], [str(row["answer"])], [float(row["scale"])])  # type: ignore[arg-type]
        assert s.reward == pytest.approx(mine + 0.5 * 2.0), (s, text, row)
    assert not any(isinstance(e.payload, ev.SampleFailed) for e in events)


@pytest.mark.slow
def test_misbehaving_reward_functions_fail_their_samples_and_the_run_still_completes(
    redis_url: str, tmp_path: Path
) -> None:
    bad = ["raise", "nan", "count", "string"]
    rows = [{"prompt": "1+1=", "answer": "2", "mode": m} for m in bad]
    rows += [{"prompt": p, "answer": a, "mode": "ok"} for p, a in ROWS]
    f = write_jsonl(tmp_path / "t.jsonl", rows)
    task = jsonl_task(f, ("plugins_for_tests:misbehaves", 1.0), max_consecutive_reward_failures=1000)
    events, summary = execute(redis_url, "misbehaves", tmp_path, small(task=task, admission={"max_inflight_groups": 4}))
    assert summary.status == RunStatus.COMPLETED
    failed = [e.payload for e in events if isinstance(e.payload, ev.SampleFailed) and e.payload.stage == "reward"]
    group_prompt = {
        e.payload.group_id: dataset_prompt_id(e.payload.prompt_id)
        for e in events
        if isinstance(e.payload, ev.GroupAdmitted)
    }
    reasons = {
        "raise": "raised ValueError: this row is poisoned",
        "nan": "returned nan",
        "count": "returned 0 values for 1 completions",
        "string": "returned 'oops' (str), not a number",
    }
    for i, mode in enumerate(bad):  # the first four prompts are admitted first: each one's samples fail, named
        mine = [p for p in failed if group_prompt[p.group_id] == f"jsonl-{i}"]
        assert mine and all(p.error == f"reward function 'plugins_for_tests:misbehaves' {reasons[mode]}" for p in mine)
    assert {group_prompt[p.group_id] for p in failed} == {f"jsonl-{i}" for i in range(len(bad))}
    # no silent zero: a failed sample has no score, its group is never trained on, every score is the function's 1.0
    scored = [e.payload for e in events if isinstance(e.payload, ev.SampleScored)]
    assert {s.sample_id for s in scored}.isdisjoint({p.sample_id for p in failed})
    assert all(s.reward == 1.0 for s in scored)
    trained = {g for e in events if isinstance(e.payload, ev.BatchConsumed) for g in e.payload.group_ids}
    assert trained.isdisjoint({p.group_id for p in failed}) and summary.steps == 3
    cancelled = {e.payload.group_id for e in events if isinstance(e.payload, ev.GroupCancelled)}
    assert {p.group_id for p in failed} <= cancelled
    report = audit(events)
    assert report.ok and not report.warnings, report.render()


@pytest.mark.slow
def test_a_reward_function_that_always_fails_ends_the_run_failed_naming_it(redis_url: str, tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "t.jsonl", [{"prompt": p, "answer": a} for p, a in ROWS])
    task = jsonl_task(f, ("plugins_for_tests:always_raises", 1.0), max_consecutive_reward_failures=6)
    events, summary = execute(redis_url, "always-fails", tmp_path, small(task=task))
    assert summary.status == RunStatus.FAILED
    [end] = [e.payload for e in events if isinstance(e.payload, ev.RunFinished)]
    assert "samples in a row could not be scored" in end.reason
    assert (
        "reward function 'plugins_for_tests:always_raises' raised RuntimeError: the reward service is down"
        in end.reason
    )
    assert not any(isinstance(e.payload, ev.SampleScored) for e in events) and summary.steps == 0
