"""Multi-turn episodes (issue 40) through a real vLLM CPU server: `rolledger run --engine vllm` with a task whose
environment answers every policy turn (tests/plugins_for_tests.py:counting_env, "=k" to the k-th turn, done after
the third). Each policy turn after the first is one `POST /v1/completions` from the prompt and every token so far
(the policy's and the environment's, as token ids); the trajectory alternates policy and environment turns, the
environment's tokens have loss mask 0 and logprob 0, the policy's are vLLM's logprobs, and the audit (invariant 10
included) holds. One server (one rank), started for this module alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rolledger.schemas import events as ev
from rolledger.workers.policy.policy_model import load_policy
from rolledger.workflows.audit import audit

from .conftest import LOOP_CONFIG, LoopServers, started_loop_servers
from .test_vllm_loop import execute, of

pytestmark = pytest.mark.vllm

EPISODES: dict[str, object] = {
    **LOOP_CONFIG,
    "ranks": 1,
    "steps": 2,
    "task": {
        "num_prompts": 16,
        "env": "plugins_for_tests:counting_env",
        "max_turns": 3,
        "max_episode_tokens": 40,
        "env_timeout_s": 60,  # two loaded cores: a step's process may wait for the CPU behind the server
    },
}


@pytest.fixture(scope="module")
def episode_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopServers]:
    with started_loop_servers(tmp_path_factory, "vllm_episodes", EPISODES) as servers:
        yield servers


def test_one_multi_turn_episode_runs_end_to_end_through_vllm(
    episode_servers: LoopServers, redis_url: str, run_id: str, tmp_path: Path
) -> None:
    cfg = episode_servers.config(**{k: v for k, v in EPISODES.items() if k != "engine"})
    assert cfg.task.episodes and cfg.ranks == 1
    events, summary, wall_s = execute(redis_url, run_id, tmp_path, cfg, episode_servers)
    assert summary.status == "completed" and summary.steps == 2
    report = audit(events)
    assert report.ok, report.render()
    finished = [p.trajectory for p in of(events, ev.SampleFinished)]
    assert finished and all(t.engine == "vllm" for t in finished)
    assert report.checked[10] == len(finished)  # invariant 10 (episodes' turns and sources) looked at every one
    _, tok = load_policy(episode_servers.model_dir)
    for t in finished:
        sources = [turn.source for turn in t.turns]
        assert sources == ["policy", "env"] * 3, sources  # counting_env is done after the policy's third turn
        assert t.turns[0].start == 0 and t.turns[-1].end == len(t.token_ids)
        assert all(a.end == b.start for a, b in zip(t.turns, t.turns[1:], strict=False))  # in order, no gap
        for k, turn in enumerate(t.turns):
            ids, mask, lps = (list(a[turn.start : turn.end]) for a in (t.token_ids, t.loss_mask, t.logprobs))
            if turn.source == "env":  # "=k" to the policy's k-th turn, as the run's tokenizer encodes it
                assert ids == tok(f"={k // 2 + 1}", add_special_tokens=False)["input_ids"]
                assert mask == [0] * len(ids) and lps == [0.0] * len(ids)
            else:  # vLLM's tokens and logprobs
                assert ids and mask == [1] * len(ids) and all(lp <= 0 for lp in lps)
            assert turn.began <= turn.ended
    scored = {p.sample_id for p in of(events, ev.SampleScored)}
    assert {t.trajectory_id for t in finished} <= scored
    steps = of(events, ev.TrainStepFinished)
    assert len(steps) == 2
    print(
        f"\nvLLM episodes: {wall_s:.1f} s for {len(steps)} steps, {len(finished)} episodes of "
        f"{sorted({len(t.token_ids) for t in finished})} tokens; logprob gap median per step "
        f"{[f'{s.logprob_gap_median:.2e}' for s in steps if s.agreement_tokens]}"
    )
