"""Episodes end to end (issue 40) on the real loop: a real redis-server, the torch engine with the tiny model, every
worker a thread. The policy and an environment take turns; the log shows each token's source (the environment's with
loss mask 0 and no logprob), the audit's invariant 10 holds, an environment that raises, hangs or answers garbage
fails only its own sample, and an interruptible run's episodes go on across updates with their spans stamped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_run_loop import execute, of, small

from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.workers.policy.policy_model import build_tokenizer
from rolledger.workflows.audit import audit
from rolledger.workflows.event_lines import EventFilter, lines
from rolledger.workflows.lineage import lineage
from rolledger.workflows.ui_view import event_detail

pytestmark = pytest.mark.slow


def episodes(env: str, **kw: Any) -> RunConfig:
    task = {"num_prompts": 16, "env": f"plugins_for_tests:{env}", "max_turns": 3, "max_episode_tokens": 40}
    task.update(kw.pop("task", {}))
    return small(**{"steps": 2, "ranks": 1, "task": task, **kw})


def test_the_policy_and_the_environment_take_turns_and_only_the_policy_is_trained_on(
    redis_url: str, run_id: str, tmp_path: Path
) -> None:
    events, summary = execute(redis_url, run_id, tmp_path, episodes("counting_env"))
    assert summary.status == "completed" and summary.steps == 2
    report = audit(events)
    assert report.ok, report.render()
    finished = [p.trajectory for p in of(events, ev.SampleFinished)]
    assert finished and report.checked[10] == len(finished)
    tok = build_tokenizer()
    for t in finished:
        assert [turn.source for turn in t.turns] == ["policy", "env"] * 3  # counting_env is done after 3 turns
        assert t.finish_reason == "stop" and t.turns[-1].end == len(t.token_ids)
        for k, turn in enumerate(t.turns):
            ids, mask, lps = (list(a[turn.start : turn.end]) for a in (t.token_ids, t.loss_mask, t.logprobs))
            if turn.source == "env":  # the reply "=k" to the policy's k-th turn, as the tokenizer encodes it
                assert ids == tok(f"={k // 2 + 1}", add_special_tokens=False)["input_ids"]
                assert mask == [0] * len(ids) and lps == [0.0] * len(ids)
            else:
                assert ids and mask == [1] * len(ids) and all(lp <= 0 for lp in lps)
            assert turn.began <= turn.ended
    scored = {p.sample_id for p in of(events, ev.SampleScored)}
    assert {t.trajectory_id for t in finished} <= scored
    # `rolledger lineage`, `rolledger events` and the UI's event list show each turn with its source
    t = finished[0]
    tree = lineage(events, t.trajectory_id).render()
    assert "episode: 6 turns (3 of the policy, 3 of the environment)" in tree
    assert f"turn 0: policy, tokens [0,{t.turns[0].end}) by v{t.policy_version}, trained on" in tree
    assert f"turn 1: environment, tokens [{t.turns[1].start},{t.turns[1].end}), not trained on" in tree
    shown = " ".join(f"{turn.source}[{turn.start},{turn.end})" for turn in t.turns)
    finished_lines = [
        x.render() for x in lines([("0-1", e) for e in events], EventFilter(types=frozenset({"SampleFinished"})))
    ]
    line = next(x for x in finished_lines if t.trajectory_id in x)
    assert f"turns={shown}" in line or f"turns='{shown}'" in line, line
    detail = next(
        event_detail(e) for e in events if isinstance(e.payload, ev.SampleFinished) and e.payload.trajectory == t
    )
    assert detail.endswith(f"turns={shown}")


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ("raising_env", "raised ValueError: the tool crashed on"),
        ("hanging_env", "timed out after 1 s"),
        ("garbage_env", "returned a str, not an EnvReply"),
    ],
)
def test_a_misbehaving_environment_fails_only_its_own_sample(
    redis_url: str, run_id: str, tmp_path: Path, env: str, reason: str
) -> None:
    """The environment misbehaves on the sample of index 1 of every group: that sample fails (stage "env", one line
    naming the environment and the turn), its group completes with the other three, the run trains to its end."""
    cfg = episodes(env, task={"env_timeout_s": 1.0}, partial_policy={"kind": "at_least", "k": 3})
    events, summary = execute(redis_url, run_id, tmp_path, cfg)
    assert summary.status == "completed" and summary.steps == 2
    report = audit(events)
    assert report.ok, report.render()
    failed = of(events, ev.SampleFailed)
    assert failed and all(p.index == 1 and p.stage == "env" for p in failed), failed
    for p in failed:
        assert p.error.startswith(f"environment 'plugins_for_tests:{env}' {reason}") and "\n" not in p.error
        assert p.error.endswith(f"(answering turn 0 of {p.sample_id})")
    finished = of(events, ev.SampleFinished)
    assert finished and all(p.trajectory.index != 1 for p in finished)
    assert all(len(p.trajectory.turns) == 6 for p in finished)  # the others ran their whole episodes


def test_interruptible_episodes_go_on_across_updates_with_their_versions_stamped(
    redis_url: str, run_id: str, tmp_path: Path
) -> None:
    """A slow environment holds episodes open across updates: the keep drain parks them, the update commits, and
    their next turns run on the new weights; each version's tokens are stamped (spans) and the audit holds."""
    cfg = episodes("slow_env", steps=6, interruptible=True, trainer={"warm_start_steps": 0, "groups_per_step": 1})
    events, summary = execute(redis_url, run_id, tmp_path, cfg)
    assert summary.status == "completed"
    report = audit(events)
    assert report.ok, report.render()
    spanning = [p.trajectory for p in of(events, ev.SampleFinished) if p.trajectory.spans]
    assert spanning, "no episode went on across an update: the test did not exercise it"
    published = {p.version: p.weights_digest for p in of(events, ev.PolicyPublished)}
    for t in spanning:
        versions = [s.policy_version for s in t.spans]
        assert versions == sorted(set(versions)) and t.spans[-1].end == len(t.token_ids)
        assert all(s.weights_digest == published[s.policy_version] for s in t.spans if s.policy_version)


@pytest.mark.parametrize(
    "kw",
    [
        {"partial_policy": {"kind": "first_k", "k": 2}},  # each episode logged as it ends; the rest cut once k ended
        {"rank_slots": 2, "rank_capacity": "sequences"},  # an episode's sequence is released when it ends
    ],
    ids=["first_k", "sequences"],
)
def test_episodes_under_first_k_and_capacity_in_sequences(
    redis_url: str, run_id: str, tmp_path: Path, kw: dict[str, Any]
) -> None:
    events, summary = execute(redis_url, run_id, tmp_path, episodes("slow_env", **kw))
    assert summary.status == "completed"
    report = audit(events)
    assert report.ok, report.render()
    finished = of(events, ev.SampleFinished)
    assert finished and all(len(p.trajectory.turns) == 6 for p in finished)
    if "partial_policy" in kw:  # the group completed on its first two episodes; the others were cut short or late
        completed = of(events, ev.GroupCompleted)
        assert completed and all(len(g.accepted) == 2 for g in completed)
