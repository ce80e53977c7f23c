"""Episodes (a task with an environment, issue 40), without a run: the turn rules, the config fields, the wire form
of a trajectory's turns (and old logs without them), the audit's invariant 10 on logs built to break it, and the
environment pool's answer to every way a step can misbehave."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
from logbuilder import LogBuilder

from rolledger.events.codec import decode, encode
from rolledger.schemas import events as ev
from rolledger.schemas.config import ConfigError, RunConfig, SamplingParams, TaskConfig
from rolledger.schemas.episode import EnvHistory, EnvReply, EnvTurn
from rolledger.schemas.trajectory import Trajectory, Turn, VersionSpan
from rolledger.schemas.wire import encoded_size, map_form_size, wire_form
from rolledger.workers.policy.envs import EnvPool
from rolledger.workers.policy.run_inputs import RunRefused, check_task
from rolledger.workers.policy.tasks import calculator_env
from rolledger.workers.roles.reward import answer_tokens
from rolledger.workflows.admission import sample_reserve
from rolledger.workflows.audit import audit
from rolledger.workflows.episode import ReplyOutcome, after_reply, episode_problems, join_spans, next_turn_tokens
from rolledger.workflows.scheduler import PromptItem

ENV = "plugins_for_tests:counting_env"
TASK = TaskConfig(env=ENV, max_turns=3, max_episode_tokens=12)


# ---------------------------------------------------------------- the rules
def test_a_turn_gets_max_tokens_within_the_budget_and_none_past_the_turn_limit() -> None:
    sampling = SamplingParams(max_tokens=4)
    assert next_turn_tokens(TASK, sampling, used=3, policy_turns=1) == 4
    assert next_turn_tokens(TASK, sampling, used=10, policy_turns=1) == 2  # the budget leaves 2
    assert next_turn_tokens(TASK, sampling, used=3, policy_turns=3) == 0  # three policy turns: the limit


def test_a_reply_is_appended_while_the_policy_can_answer_it() -> None:
    assert after_reply(TASK, used=4, policy_turns=1, reply_tokens=2, done=False) == ReplyOutcome(True, None)
    # done: the reply is kept when it fits, and the episode stops
    assert after_reply(TASK, used=4, policy_turns=1, reply_tokens=2, done=True) == ReplyOutcome(True, "stop")
    assert after_reply(TASK, used=11, policy_turns=1, reply_tokens=2, done=True) == ReplyOutcome(False, "stop")
    # the turn limit, or a reply that would leave the policy no token: ends without it
    assert after_reply(TASK, used=4, policy_turns=3, reply_tokens=2, done=False) == ReplyOutcome(False, "length")
    assert after_reply(TASK, used=10, policy_turns=1, reply_tokens=2, done=False) == ReplyOutcome(False, "length")


def test_spans_join_across_turns_and_split_where_the_weights_changed() -> None:
    assert join_spans([(0, 1, "w1")], 5, [(0, 1, "w1")]) == [(0, 1, "w1")]
    assert join_spans([(0, 1, "w1")], 5, [(0, 1, "w1"), (2, 2, "w2")]) == [(0, 1, "w1"), (7, 2, "w2")]
    assert join_spans([(0, 1, "w1")], 5, [(0, 2, "w2")]) == [(0, 1, "w1"), (5, 2, "w2")]


# ---------------------------------------------------------------- config
def test_the_episode_fields_are_validated_naming_the_field(tmp_path: Path) -> None:
    for body, field in [
        ('env = "not a path"', "task.env"),
        ('env = "m:f"\nmax_turns = 0', "task.max_turns"),
        ('env = "m:f"\nenv_timeout_s = -1', "task.env_timeout_s"),
        ('env = "m:f"\nenv_workers = 0', "task.env_workers"),
        ('env = "m:f"\nmax_turn = 3', "task.max_turn"),
    ]:
        path = tmp_path / "c.toml"
        path.write_text(f"[task]\n{body}\n")
        with pytest.raises(ConfigError, match=rf"c\.toml: {field}: ") as caught:
            RunConfig.load(path)
        assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="task.max_episode_tokens=3 is below sampling.max_tokens=4"):
        RunConfig.model_validate({"task": {"env": "m:f", "max_episode_tokens": 3}})


def test_an_environment_that_cannot_be_imported_is_refused_before_the_run() -> None:
    check_task(RunConfig.model_validate({"task": {"env": ENV}}))
    for path, why in [
        ("plugins_for_tests:no_such_env", "has no attribute"),
        ("no_such_module:step", "not found"),
        ("plugins_for_tests:NOT_CALLABLE", "not callable"),
    ]:
        with pytest.raises(RunRefused, match=rf"^task\.env: '{path}'.*{why}"):
            check_task(RunConfig.model_validate({"task": {"env": path}}))


# ---------------------------------------------------------------- the trajectory's turns on the wire
def episode_fields(**overrides: Any) -> dict[str, Any]:
    """An episode of 6 tokens: the policy's [0,2), the environment's [2,4), the policy's [4,6)."""
    fields: dict[str, Any] = {
        "token_ids": [7, 8, 14, 4, 9, 2],
        "loss_mask": [1, 1, 0, 0, 1, 1],
        "positions": [3, 4, 5, 6, 7, 8],
        "logprobs": [-0.5, -0.25, 0.0, 0.0, -0.1, -0.2],
        "turns": (
            Turn(start=0, end=2, source="policy", began=10.0, ended=11.0),
            Turn(start=2, end=4, source="env", began=11.0, ended=11.5),
            Turn(start=4, end=6, source="policy", began=11.5, ended=12.0),
        ),
    }
    fields.update(overrides)
    return fields


def trajectory(**overrides: Any) -> Trajectory:
    base: dict[str, Any] = {
        "trajectory_id": "g000001/0",
        "group_id": "g000001",
        "prompt_id": "p",
        "index": 0,
        "prompt_token_ids": [1, 2, 3],
        "logprob_mode": "raw",
        "finish_reason": "stop",
        "sampling": SamplingParams(),
        "policy_version": 0,
        "weights_digest": "w0000",
        "rank": 0,
        "engine": "torch",
        "cache_generation": 0,
        "graph_generation": 0,
        **episode_fields(),
    }
    base.update(overrides)
    return Trajectory(**base)


def test_turns_round_trip_and_count_in_the_accounting_size() -> None:
    t = trajectory()
    e = LogBuilder(task=TASK).emit(ev.SampleFinished(trajectory=t, nbytes=encoded_size(t))).last
    back = decode(encode(e))
    assert isinstance(back.payload, ev.SampleFinished) and back.payload.trajectory.turns == t.turns
    assert encoded_size(t) == map_form_size(t)
    single = trajectory(turns=())
    assert encoded_size(single) == map_form_size(single)  # no turns: left out of the map form, as before episodes
    assert "turns" not in wire_form(single) and "turns" in wire_form(t)


def test_a_v1_sample_finished_and_sample_failed_still_decode() -> None:
    """Written before episodes: a trajectory of 19 fields (no turns) in SampleFinished v1, SampleFailed v1."""
    t = trajectory(turns=(), loss_mask=[1] * 6, logprobs=[-0.5] * 6)
    entry = msgpack.unpackb(encode(LogBuilder().emit(ev.SampleFinished(trajectory=t, nbytes=encoded_size(t))).last))
    assert entry[1] == 2 and entry[3][0][-1] == []  # v2: the trajectory's last field is its turns
    entry[1], entry[3][0] = 1, entry[3][0][:-1]
    old = decode(msgpack.packb(entry))
    assert isinstance(old.payload, ev.SampleFinished) and old.payload.trajectory == t
    failed = ev.SampleFailed(sample_id="g1/0", group_id="g1", index=0, rank=0, error="boom")
    entry = msgpack.unpackb(encode(LogBuilder().emit(failed).last))
    entry[1] = 1
    assert decode(msgpack.packb(entry)).payload == failed


def test_admission_reserves_an_episode_at_its_budget_and_turns() -> None:
    item = PromptItem(0, "p", (1, 2, 3), "5")
    task = TaskConfig(env=ENV, max_turns=3, max_episode_tokens=6)
    reserve = sample_reserve("g000001", item, 1, SamplingParams(max_tokens=4), False, task)
    assert reserve > sample_reserve("g000001", item, 1, SamplingParams(max_tokens=4), False)
    longest = trajectory(  # every token, 6 turns (3 of each), the widest integers
        trajectory_id="g000001/0", prompt_id="p", index=0, policy_version=2**32 - 1, rank=2**32 - 1
    )
    assert encoded_size(longest) <= reserve


def test_an_episode_is_scored_on_the_policys_last_turn() -> None:
    assert answer_tokens(trajectory()) == [9, 2]
    assert answer_tokens(trajectory(turns=())) == [7, 8, 14, 4, 9, 2]


# ---------------------------------------------------------------- the audit's invariant 10
def episode_log(*, interruptible: bool = False, **overrides: Any) -> list[ev.Event]:
    """A finished run of one group of two episodes, the first with `overrides` on its trajectory."""
    b = LogBuilder(task=TASK, interruptible=interruptible).start_run()
    b.admit()
    g = b.last_group
    for i in range(2):
        b.start(f"{g}/{i}")
    for i in range(2):
        b.finish(f"{g}/{i}", **episode_fields(**(overrides if i == 0 else {})))
    for i in range(2):
        b.score(f"{g}/{i}")
    b.complete(g)
    return b.finish_run().build()


def violations(events: list[ev.Event]) -> list[str]:
    report = audit(events)
    others = [v for v in report.violations if v.invariant != 10]
    assert not others, report.render()
    return [v.message for v in report.violations]


def test_well_formed_episodes_pass() -> None:
    report = audit(episode_log())
    assert report.ok, report.render()
    assert report.checked[10] == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loss_mask": [1, 1, 1, 0, 1, 1]}, "environment token 2 is trained on"),
        ({"logprobs": [-0.5, -0.25, 0.0, -1.5, -0.1, -0.2]}, "environment token 3 carries a logprob"),
        (
            {
                "turns": (
                    Turn(start=0, end=2, source="policy", began=10, ended=11),
                    Turn(start=3, end=6, source="env", began=11, ended=12),
                )
            },
            "turn 1 (env, [3,6)) does not follow token 2",
        ),
        (
            {
                "turns": (
                    Turn(start=0, end=3, source="policy", began=10, ended=11),
                    Turn(start=3, end=6, source="policy", began=11, ended=12),
                )
            },
            "does not alternate",
        ),
        (
            {
                "turns": (
                    Turn(start=0, end=2, source="env", began=10, ended=11),
                    Turn(start=2, end=6, source="policy", began=11, ended=12),
                )
            },
            "is not the policy's",
        ),
        (
            {
                "turns": (
                    Turn(start=0, end=2, source="policy", began=10, ended=11),
                    Turn(start=2, end=6, source="env", began=10.5, ended=12),
                )
            },
            "began at 10.500000, before the turn before it ended at 11.000000",
        ),
        ({"turns": (Turn(start=0, end=4, source="policy", began=10, ended=11),)}, "turns cover 4 of 6 tokens"),
        # a span that does not reach the last policy turn: tokens 4 and 5 have no version
        ({"spans": (VersionSpan(start=0, end=4, policy_version=0, weights_digest="w0000"),)}, "policy token 4"),
        # a version nobody published
        (
            {
                "spans": (
                    VersionSpan(start=0, end=4, policy_version=0, weights_digest="w0000"),
                    VersionSpan(start=4, end=6, policy_version=3, weights_digest="w0003"),
                )
            },
            "tokens on v3, newer than the newest published version v0",
        ),
    ],
)
def test_a_broken_episode_fails_invariant_10(overrides: dict[str, Any], message: str) -> None:
    # two versions in one sample: an interruptible run's (else invariant 1 refuses them first)
    found = violations(episode_log(interruptible="newer than" in message, **overrides))
    assert len(found) == 1 and message in found[0] and "episode g000001/0" in found[0], found


def test_turns_exactly_when_the_task_has_an_environment() -> None:
    b = LogBuilder().start_run()  # no environment
    b.admit()
    g = b.last_group
    b.start(f"{g}/0").start(f"{g}/1")
    b.finish(f"{g}/0", **episode_fields())
    b.finish(f"{g}/1")
    b.score(f"{g}/0").score(f"{g}/1").complete(g)
    assert violations(b.finish_run().build()) == [f"episode {g}/0: 3 turns, but the run's task has no environment"]
    t = trajectory()
    assert episode_problems(trajectory(turns=()), TASK) == ["an episode without turns (its task has an environment)"]
    assert episode_problems(t, TaskConfig(env=ENV, max_turns=1, max_episode_tokens=5)) == [
        "2 policy turns, over task.max_turns=1",
        "6 tokens, over task.max_episode_tokens=5",
    ]
    assert episode_problems(t, None) == []  # config unknown: only what needs none


# ---------------------------------------------------------------- the environment's processes
def history(sample_id: str) -> EnvHistory:
    return EnvHistory(
        sample_id=sample_id,
        prompt_id="p",
        prompt="1+2=",
        prompt_token_ids=(1, 4, 13, 5, 14),
        answer="3",
        turns=(EnvTurn(source="policy", token_ids=(6,), text="3"),),
    )


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ("raising_env", "raised ValueError: the tool crashed on g1/1"),
        ("hanging_env", "timed out after 1 s"),
        ("garbage_env", "returned a str, not an EnvReply"),
        ("invalid_env", "returned an invalid reply: done: Input should be a valid boolean"),
    ],
)
def test_a_misbehaving_step_is_a_reason_and_the_next_step_is_served(env: str, reason: str) -> None:
    pool = EnvPool(f"plugins_for_tests:{env}", workers=1, timeout_s=1.0)
    try:
        assert pool.call(history("g1/0")) == EnvReply(text="=1", info={"turn": 1})
        assert pool.call(history("g1/1")) == reason
        assert pool.call(history("g1/2")) == EnvReply(text="=1", info={"turn": 1})  # a killed process is replaced
        assert pool.started == (2 if env == "hanging_env" else 1)
    finally:
        pool.close()
    assert pool.call(history("g1/3")) == "its pool is closed (the rank is stopping)"


def test_replies_as_dicts_and_token_ids_are_validated_like_replies() -> None:
    pool = EnvPool("plugins_for_tests:guess_env", workers=2, timeout_s=5.0)
    try:
        assert pool.call(history("g1/0")) == EnvReply(done=True)  # "3" is the answer
        wrong = history("g1/0").model_copy(update={"turns": (EnvTurn(source="policy", token_ids=(4,), text="1"),)})
        assert pool.call(wrong) == EnvReply(text="+")
    finally:
        pool.close()
    pool = EnvPool("plugins_for_tests:token_env", workers=1, timeout_s=5.0)
    try:
        assert pool.call(history("g1/0")) == EnvReply(token_ids=(13, 14))
    finally:
        pool.close()
    with pytest.raises(ValueError, match="text or as token_ids, not both"):
        EnvReply(text="=", token_ids=(14,))


def test_the_calculator_answers_a_sum_once_and_ends_on_an_answer() -> None:
    def asked(*turns: tuple[str, str]) -> EnvReply:
        return calculator_env(
            history("g1/0").model_copy(
                update={"turns": tuple(EnvTurn(source=src, token_ids=(), text=text) for src, text in turns)}  # type: ignore[arg-type]
            )
        )

    assert asked(("policy", "23+19")) == EnvReply(text="=42")
    assert asked(("policy", "42")) == EnvReply(done=True)
    assert asked(("policy", "23+19"), ("env", "=42"), ("policy", "23+19")) == EnvReply(done=True)  # one call


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('env = "plugins_for_tests:counting_env"\nmax_turns = 0', "task.max_turns: Input should be greater than"),
        ('env = "plugins_for_tests:no_such_env"', "task.env: 'plugins_for_tests:no_such_env'"),
    ],
)
def test_rolledger_run_exits_2_naming_the_field(tmp_path: Path, body: str, needle: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f"[task]\n{body}\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rolledger.workers.operator.cli",
            "run",
            "--config",
            str(cfg),
            "--runs-dir",
            str(tmp_path),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], done.stderr
