"""Multi-turn episodes (issue 40) through a real SGLang CPU server: `rolledger run --engine sglang --ranks 1` as a user
types it, with a task whose environment answers every policy turn (tests/plugins_for_tests.py:counting_env, "=k" to
the k-th turn, done after the third). Each policy turn after the first is one `/generate` request from the prompt and
every token so far (`input_ids`: the policy's and the environment's); the trajectory alternates policy and
environment turns, the environment's tokens have loss mask 0 and logprob 0, and `rolledger audit` (invariant 10
included) passes. The twins: tests/test_episodes_run.py (torch engine), tests/vllm_tier/test_vllm_episodes.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
from rolledger.workers.policy.policy_model import build_tokenizer

from .test_sglang_loop import of

pytestmark = pytest.mark.sglang

TESTS_DIR = Path(__file__).resolve().parents[1]  # plugins_for_tests.py: the run imports its environment from here

EPISODES_CONFIG = """
group_size = 4
[trainer]
warm_start_steps = 20
groups_per_step = 2
[task]
num_prompts = 16
env = "plugins_for_tests:counting_env"
max_turns = 3
max_episode_tokens = 40
env_timeout_s = 60
[update]
prepare_deadline_s = 120
drain_deadline_s = 120
commit_deadline_s = 120
[model]
architecture = "llama"
"""


def test_one_multi_turn_episode_runs_end_to_end_through_sglang(redis_url: str, run_id: str, tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(EPISODES_CONFIG)
    runs = tmp_path / "runs"
    common = ("--redis", redis_url, "--runs-dir", str(runs))
    argv = ["run", "--config", str(config), "--engine", "sglang", "--ranks", "1", "--steps", "2", "--run-id", run_id]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH")) if p)}
    exe = Path(sys.executable).parent / "rolledger"
    run = subprocess.run([str(exe), *argv, *common], check=False, capture_output=True, text=True, timeout=900, env=env)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(runs.glob(f"{run_id}/sglang-rank*.log")))
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{logs}"
    client = redis.Redis.from_url(redis_url)
    events = [s.event for s in EventLog(client, run_id).read()]
    client.close()
    finished = [p.trajectory for p in of(events, ev.SampleFinished)]
    assert finished and {t.engine for t in finished} == {"sglang"}
    tok = build_tokenizer()  # the run's policy tokenizer (the character tokenizer)
    for t in finished:
        sources = [turn.source for turn in t.turns]
        assert sources == ["policy", "env"] * 3, sources  # counting_env is done after the policy's third turn
        assert t.turns[0].start == 0 and t.turns[-1].end == len(t.token_ids)
        assert all(a.end == b.start for a, b in zip(t.turns, t.turns[1:], strict=False))  # in order, no gap
        for k, turn in enumerate(t.turns):
            ids, mask, lps = (list(a[turn.start : turn.end]) for a in (t.token_ids, t.loss_mask, t.logprobs))
            if turn.source == "env":
                assert ids == tok(f"={k // 2 + 1}", add_special_tokens=False)["input_ids"]
                assert mask == [0] * len(ids) and lps == [0.0] * len(ids)
            else:  # SGLang's tokens and logprobs
                assert ids and mask == [1] * len(ids) and all(lp <= 0 for lp in lps)
    audit = subprocess.run(
        [str(exe), "audit", run_id, *common], check=False, capture_output=True, text=True, timeout=300, env=env
    )
    assert audit.returncode == 0, audit.stdout[-4000:] + audit.stderr[-2000:]
    print(f"\nSGLang episodes: {len(finished)} episodes; audit: {audit.stdout.strip().splitlines()[0][:200]}")
