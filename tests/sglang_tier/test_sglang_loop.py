"""`rolledger run --engine sglang --ranks 2 --steps 2 --inject fail-rank=1@prepare`, as a user types it: the real loop
on a real redis-server, two SGLang CPU servers started by the run from its own policy, the first update failing on
rank 1. It must abort that update on both ranks, commit the next, and `rolledger audit` must pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TypeVar

import pytest
import redis

from rolledger.events.store import EventLog
from rolledger.schemas import events as ev

pytestmark = pytest.mark.sglang

CONFIG = """
group_size = 4
[trainer]
warm_start_steps = 20
groups_per_step = 2
[task]
num_prompts = 64
[update]
prepare_deadline_s = 120
drain_deadline_s = 120
commit_deadline_s = 120
[model]
architecture = "llama"
"""

P = TypeVar("P", bound=ev.Payload)


def of(events: list[ev.Event], cls: type[P]) -> list[P]:
    return [e.payload for e in events if isinstance(e.payload, cls)]


def rolledger(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "rolledger"
    return subprocess.run([str(exe), *argv], check=False, capture_output=True, text=True, timeout=timeout)


def run_on_sglang(
    config_text: str, redis_url: str, run_id: str, tmp_path: Path, *argv: str
) -> tuple[list[ev.Event], tuple[str, ...]]:
    """`rolledger run --engine sglang --ranks 2` with this config and `argv`, as a user types it; it must exit 0
    (else the servers' logs are shown). The run's events, and the arguments that name its Redis and runs dir."""
    config = tmp_path / "run.toml"
    config.write_text(config_text)
    runs = tmp_path / "runs"
    common = ("--redis", redis_url, "--runs-dir", str(runs))
    run = rolledger(
        "run", "--config", str(config), "--engine", "sglang", "--ranks", "2", "--run-id", run_id, *argv, *common,
        timeout=900,
    )  # fmt: skip
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(runs.glob(f"{run_id}/sglang-rank*.log")))
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{logs}"
    client = redis.Redis.from_url(redis_url)
    events = [s.event for s in EventLog(client, run_id).read()]
    client.close()
    return events, common


def test_a_failed_prepare_aborts_on_both_sglang_ranks_and_the_next_update_commits(
    redis_url: str, run_id: str, tmp_path: Path
) -> None:
    events, common = run_on_sglang(
        CONFIG, redis_url, run_id, tmp_path, "--steps", "2", "--inject", "fail-rank=1@prepare"
    )
    joined = of(events, ev.RankJoined)  # rank 1 joins again after its quarantine
    assert {j.rank for j in joined} == {0, 1} and {j.engine for j in joined} == {"sglang"}
    failed = of(events, ev.RankPrepareFailed)
    assert [(f.rank, f.phase) for f in failed] == [(1, "prepare")]
    aborted = of(events, ev.UpdateAborted)
    assert len(aborted) >= 1
    assert not [c for c in of(events, ev.RankCommitted) if c.version == aborted[0].version]  # on neither rank
    published = of(events, ev.PolicyPublished)
    # rank 1 was quarantined by the abort: it takes part in the next update only if it has rejoined by then (timing)
    assert published and all(0 in p.ranks for p in published)
    staged = {p.version: p.weights_digest for p in of(events, ev.UpdateStaged)}
    for p in published:  # every rank of the publish answered its commit with the staged digest, read back from SGLang
        commits = {c.rank: c.weights_digest for c in of(events, ev.RankCommitted) if c.version == p.version}
        assert commits == dict.fromkeys(p.ranks, staged[p.version])
    trajectories = [p.trajectory for p in of(events, ev.SampleFinished)]
    assert trajectories and {t.engine for t in trajectories} == {"sglang"}
    audit = rolledger("audit", run_id, *common, timeout=300)
    assert audit.returncode == 0, audit.stdout[-4000:] + audit.stderr[-2000:]
    print(
        f"\nSGLang loop: {len(aborted)} aborted, published {[(p.version, p.ranks) for p in published]}; audit: "
        f"{audit.stdout.strip().splitlines()[0][:200]}"
    )


RECYCLE_CONFIG = """
group_size = 4
recycle_aborted = true
[trainer]
warm_start_steps = 0
groups_per_step = 2
[task]
num_prompts = 64
[sampling]
max_tokens = 40
temperature = 1.0
[admission]
max_lag = 2
[update]
drain_mode = "abort"
prepare_deadline_s = 120
drain_deadline_s = 120
commit_deadline_s = 120
[model]
architecture = "llama"
"""


def test_samples_an_abort_drain_cuts_are_recycled_under_the_new_version_on_sglang(
    redis_url: str, run_id: str, tmp_path: Path
) -> None:
    """`recycle_aborted` on real SGLang servers: every update drains with "abort" (`/pause_generation` mode abort;
    SGLang answers each aborted request with the tokens it had, finish_reason abort); each cut sample is continued
    from them on the new version, so it finishes with a span per version, and the run audits clean (the twins:
    tests/test_interruptible.py on torch, tests/vllm_tier/test_vllm_loop.py on vLLM). The policy is not
    warm-started, so its samples run tens of tokens, long enough for each update's drain to cut some."""
    from test_interruptible import (
        assert_cut_samples_cancelled_only_in_groups_closed_first,
        assert_recycled_across_updates,
    )

    events, common = run_on_sglang(RECYCLE_CONFIG, redis_url, run_id, tmp_path, "--steps", "4")
    assert_cut_samples_cancelled_only_in_groups_closed_first(events)
    recycled = assert_recycled_across_updates(events, "sglang", max_tokens=40)
    audit = rolledger("audit", run_id, *common, timeout=300)
    assert audit.returncode == 0, audit.stdout[-4000:] + audit.stderr[-2000:]
    print(f"\nSGLang recycling: {recycled} samples continued across an update")
