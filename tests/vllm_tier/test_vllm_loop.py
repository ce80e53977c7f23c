"""`rolledger run --engine vllm`: the real loop (coordinator, two vLLM ranks, reward, trainer, all through the log
on a real redis-server) driving two real vLLM CPU servers.

The servers serve the run's own initial policy (float32, warm-started; see conftest.LoopServers), so the trainer's
logprob-agreement check compares the engine's logprobs with the very weights it trains. Each test checks the log
(audit, replay, the update transactions) and what the servers themselves report afterwards.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import TypeVar

import pytest
from test_interruptible import assert_cut_samples_cancelled_only_in_groups_closed_first, assert_recycled_across_updates
from test_run_loop import execute as run_and_check

from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig, SamplingParams
from rolledger.workers.engines.factory import build_engines
from rolledger.workers.engines.protocol import EngineError
from rolledger.workflows.audit import audit
from rolledger.workflows.summary import Summary

from .conftest import PROMPT, LoopServers

pytestmark = pytest.mark.vllm

GREEDY_PROMPTS: tuple[tuple[int, ...], ...] = (PROMPT, (1, 5, 9, 14, 7, 15))


def execute(
    redis_url: str, run_id: str, runs_dir: Path, cfg: RunConfig, servers: LoopServers, *injections: str
) -> tuple[list[ev.Event], Summary, float]:
    """The main suite's run-and-check (tests/test_run_loop.py), on a run directory seeded with the servers' policy."""
    servers.seed_run_dir(runs_dir / run_id)
    started = time.perf_counter()
    events, summary = run_and_check(redis_url, run_id, runs_dir, cfg, *injections, deadline_s=300)
    return events, summary, time.perf_counter() - started


P = TypeVar("P", bound=ev.Payload)


def of(events: list[ev.Event], cls: type[P]) -> list[P]:
    return [e.payload for e in events if isinstance(e.payload, cls)]


def assert_every_rank_joined_before_the_first_update(events: list[ev.Event]) -> None:
    """Both ranks must take part in every transaction; the coordinator does not (yet) wait for declared ranks to join.

    A rank thread that starts late (observed: 0.8 s on two loaded cores, against a 0.4 s one-step run) misses the
    run's updates, and the test would not be testing what it says. Checked explicitly so that failure names itself.
    """
    first_prepare = next((i for i, e in enumerate(events) if isinstance(e.payload, ev.PrepareRequested)), len(events))
    joined = sorted(e.payload.rank for e in events[:first_prepare] if isinstance(e.payload, ev.RankJoined))
    assert joined == [0, 1], (
        f"ranks {joined} joined before the first PrepareRequested; the coordinator began an update before every "
        "declared rank (cfg.ranks) had joined"
    )


def served(servers: LoopServers) -> list[tuple[object, ...]]:
    """What each server serves, asked directly: weights digest, live digest, /weight_info, greedy outputs."""
    from rolledger.workers.engines.vllm_engine import VllmEngine

    from .conftest import GREEDY

    out: list[tuple[object, ...]] = []
    for r, url in enumerate(servers.urls):
        e = VllmEngine(url, rank=r, model_name=str(servers.model_dir))
        try:
            greedy = [(s.token_ids, s.logprobs) for p in GREEDY_PROMPTS for s in e.generate(p, 1, GREEDY).samples]
            out.append((e.weights_digest(), e.live_digest(), e.http.get("/weight_info")["weight_version"], greedy))
        finally:
            e.close()
    return out


def test_build_engines_refuses_a_url_count_that_is_not_the_rank_count(
    vllm_loop_servers: LoopServers, tmp_path: Path
) -> None:
    cfg = vllm_loop_servers.config(vllm_urls=vllm_loop_servers.urls[:1])
    with pytest.raises(ValueError, match="vllm_urls has 1 URL.*ranks is 2"):
        build_engines(cfg, vllm_loop_servers.model_dir, None, tmp_path)


def test_build_engines_refuses_a_public_address_before_any_request(
    vllm_loop_servers: LoopServers, tmp_path: Path
) -> None:
    from rolledger.workers.runtime.netguard import EngineAddressError

    cfg = vllm_loop_servers.config(vllm_urls=("http://8.8.8.8:8000", vllm_loop_servers.urls[1]))
    with pytest.raises(EngineAddressError):
        build_engines(cfg, vllm_loop_servers.model_dir, None, tmp_path)


def test_build_engines_refuses_servers_on_other_weights(fresh_loop_servers: LoopServers, tmp_path: Path) -> None:
    from rolledger.workers.operator.local_run import prepare_policy

    other = fresh_loop_servers.config(seed=7)  # another seed: another warm-started initial policy
    prepare_policy(other, tmp_path / "model")
    with pytest.raises(EngineError, match="not the run's initial policy"):
        build_engines(other, tmp_path / "model", None, tmp_path)


def test_build_engines_refuses_colocated_mode_without_sleep_mode(
    fresh_loop_servers: LoopServers, tmp_path: Path
) -> None:
    cfg = fresh_loop_servers.config(mode="colocated")
    with pytest.raises(EngineError, match="without sleep mode"):
        build_engines(cfg, fresh_loop_servers.model_dir, None, tmp_path)


def test_rank_engines_probe_health_while_paused_and_leave_servers_running(
    fresh_loop_servers: LoopServers, tmp_path: Path
) -> None:
    from rolledger.workers.engines.factory import initial_digest

    engines, close = build_engines(fresh_loop_servers.config(), fresh_loop_servers.model_dir, None, tmp_path)
    try:
        assert [e.capabilities.name for e in engines] == ["vllm", "vllm"]
        assert {e.weights_digest() for e in engines} == {initial_digest(fresh_loop_servers.model_dir)}
        # RankWorker's order: pause, (commit), health probe, and resume only on PolicyPublished
        reports = []
        for e in engines:
            e.pause("wait")
            reports.append(e.health())
            assert e.is_paused  # the probe did not leave the rank serving
            e.resume()
        assert all(r.ok for r in reports), reports
        assert reports[0].probe_digest == reports[1].probe_digest  # same weights, same probe
    finally:
        close()
    assert fresh_loop_servers.versions() == ["0", "0"]  # URL servers are not ours to stop


@pytest.mark.parametrize("fault", ["fail-rank=1@prepare", "corrupt-rank=0"])
def test_a_failed_update_leaves_both_servers_serving_exactly_what_they_served(
    fresh_loop_servers: LoopServers, redis_url: str, run_id: str, tmp_path: Path, fault: str
) -> None:
    # one step: its update is the run's only one and it is aborted, so the run ends on version 0
    cfg = fresh_loop_servers.config(steps=1)
    before = served(fresh_loop_servers)
    assert before[0][0] == before[1][0] and before[0][3] == before[1][3]  # both ranks serve the initial policy
    events, summary, _ = execute(redis_url, run_id, tmp_path, cfg, fresh_loop_servers, fault)
    assert_every_rank_joined_before_the_first_update(events)
    aborted = of(events, ev.UpdateAborted)
    assert len(aborted) == 1 and aborted[0].version == 1, [type(e.payload).__name__ for e in events]
    failed = of(events, ev.RankPrepareFailed)
    assert len(failed) == 1
    if fault.startswith("corrupt"):
        assert failed[0].rank == 0 and failed[0].tensor and "checksum" in failed[0].reason
    else:
        assert failed[0].rank == 1 and failed[0].phase == "prepare"
    assert not of(events, ev.RankCommitted) and not of(events, ev.PolicyPublished)
    assert summary.status == "completed" and summary.policy_version == 0
    report = audit(events)
    assert report.ok, report.render()
    after = served(fresh_loop_servers)
    assert after == before  # same weights digest, live digest, version label "0", greedy tokens and logprobs


def test_the_loop_trains_and_publishes_every_version_on_both_vllm_servers(
    fresh_loop_servers: LoopServers, redis_url: str, run_id: str, tmp_path: Path
) -> None:
    cfg = fresh_loop_servers.config()
    import json

    assert json.loads((fresh_loop_servers.model_dir / "config.json").read_text())["model_type"] == "llama"
    before = served(fresh_loop_servers)
    events, summary, wall_s = execute(redis_url, run_id, tmp_path, cfg, fresh_loop_servers)
    assert_every_rank_joined_before_the_first_update(events)
    assert summary.status == "completed" and summary.steps == 3
    report = audit(events)
    assert report.ok, report.render()
    joined = of(events, ev.RankJoined)
    assert sorted(j.rank for j in joined) == [0, 1] and all(j.engine == "vllm" for j in joined)
    initial = of(events, ev.RunStarted)[0].initial_weights_digest
    assert {j.weights_digest for j in joined} == {initial}  # the servers serve the run's own policy
    staged = {p.version: p.weights_digest for p in of(events, ev.UpdateStaged)}
    published = {p.version: p for p in of(events, ev.PolicyPublished)}
    assert sorted(published) == [1, 2, 3]
    for v, p in published.items():
        assert p.ranks == (0, 1) and p.weights_digest == staged[v]
        # both servers answered the commit with the staged digest (and /weight_info == v, checked by the engine)
        commits = {c.rank: c.weights_digest for c in of(events, ev.RankCommitted) if c.version == v}
        assert commits == {0: staged[v], 1: staged[v]}
        # and after it, asked again, reported that digest; both ranks' greedy probes agree
        health = [h for h in of(events, ev.HealthPassed) if h.version == v]
        assert sorted(h.rank for h in health) == [0, 1]
        assert {h.weights_digest for h in health} == {staged[v]}
        assert len({h.probe_digest for h in health}) == 1
    trajectories = [p.trajectory for p in of(events, ev.SampleFinished)]
    assert trajectories and all(t.engine == "vllm" for t in trajectories)
    for t in trajectories:
        assert t.weights_digest == (published[t.policy_version].weights_digest if t.policy_version else initial)
    # the trainer recomputed the engine's logprobs with its own weights on on-policy samples
    steps = of(events, ev.TrainStepFinished)
    assert len(steps) == 3
    measured = [s for s in steps if s.agreement_tokens > 0]
    assert measured, [(s.step, s.agreement_tokens) for s in steps]
    assert all(s.logprob_gap_median < 1e-3 for s in measured), [s.logprob_gap_median for s in measured]
    # what the servers serve now, asked directly: the last version, on both, and not what they served before
    after = served(fresh_loop_servers)
    assert [a[0] for a in after] == [staged[3]] * 2
    assert [a[2] for a in after] == ["3", "3"]
    assert after[0][3] == after[1][3] and after[0][3] != before[0][3]
    print(
        f"\nvLLM loop: {wall_s:.1f} s for {len(steps)} steps, {len(trajectories)} trajectories; logprob gap "
        f"median per measured step {[f'{s.logprob_gap_median:.2e}' for s in measured]} "
        f"(p99 {[f'{s.logprob_gap_p99:.2e}' for s in measured]}, tokens {[s.agreement_tokens for s in measured]}); "
        f"median of medians {statistics.median(s.logprob_gap_median for s in measured):.2e}"
    )


def test_after_an_update_the_server_computes_the_logprobs_of_the_new_weights(
    vllm_loop_servers: LoopServers, tmp_path: Path
) -> None:
    """A whole update (pause, prepare, commit, health, resume) to weights unrelated to what the server served, every
    tensor moved (the tied embedding too): the logprobs the server reports for its samples are what the new weights
    give in torch, as exactly as the float32 policy's were before any update (the trainer's agreement gate relies
    on it). vLLM's in-place reload left a tied lm_head's CPU kernel packed from the start-up weights: the samples'
    logprobs then came from the new body and the old head (median gap 1.7e-3 on the unwarmed policy), while every
    digest named the new version."""
    import torch

    from rolledger.workers.engines.vllm_engine import VllmEngine
    from rolledger.workers.policy.grpo import sequence_logprobs
    from rolledger.workers.policy.policy_model import build_model, load_policy, policy_state
    from rolledger.workers.weights.staging_store import DirectoryStagingStore

    from .conftest import LOOP_CONFIG

    _, tok = load_policy(vllm_loop_servers.model_dir)
    cfg = RunConfig.model_validate(LOOP_CONFIG)
    new_model = build_model(cfg.model, len(tok), seed=7)  # never warm-started: its samples run tens of tokens
    new = {k: v.detach().clone() for k, v in policy_state(new_model).items()}
    assert "model.embed_tokens.weight" in new and getattr(new_model.config, "tie_word_embeddings", False)
    e = VllmEngine(vllm_loop_servers.urls[0], rank=0, model_name=str(vllm_loop_servers.model_dir))
    try:
        version = e.policy_version + 1
        staged = DirectoryStagingStore(tmp_path / "staging").stage(version, e.policy_version, new)
        e.pause("abort")
        e.prepare(version, staged.uri, staged.manifest)
        e.commit_weights(version)
        assert e.health().ok
        e.resume()
        sampling = SamplingParams(temperature=1.0, max_tokens=24, seed=11, logprob_mode="raw")
        out = e.generate(list(PROMPT), 8, sampling)
    finally:
        e.close()
    with torch.no_grad():  # the trainer's raw logprobs of each sample's tokens under the new weights
        mine, _ = sequence_logprobs(new_model, [PROMPT] * len(out.samples), [s.token_ids for s in out.samples])
    gaps = sorted(abs(float(mine[row, j]) - lp) for row, s in enumerate(out.samples) for j, lp in enumerate(s.logprobs))
    print(f"\n{len(gaps)} tokens under v{version}: median gap {statistics.median(gaps):.2e}, max {gaps[-1]:.2e}")
    assert len(gaps) >= 16
    assert statistics.median(gaps) < 1e-5 and gaps[-1] < 1e-4, (statistics.median(gaps), gaps[-1])


def test_samples_an_abort_drain_cuts_are_recycled_under_the_new_version_on_vllm(
    unwarmed_loop_servers: LoopServers, redis_url: str, run_id: str, tmp_path: Path
) -> None:
    """`recycle_aborted` on real vLLM servers: every update drains with "abort" (vLLM aborts the requests, and the cut
    samples come back with the tokens they had); each cut sample is continued from them on the new version, so it
    finishes with a span per version; a cut sample is cancelled only in a group closed before it (the run's end, or
    too stale to train), and the run audits clean (the main suite's twin runs the torch engine:
    tests/test_interruptible.py). Its policy was never warm-started, so its samples run tens of tokens, long enough
    for each update's drain to cut some. Whether a drain finds a sample in flight depends on the moment its update
    lands (a rank ahead of the trainer waits on admission, idle): six updates make one that cuts nothing in all six
    improbable (the fresh-clone CI of f45f60f saw four cut nothing once under load)."""
    cfg = unwarmed_loop_servers.config(
        recycle_aborted=True,
        steps=6,
        admission={"max_lag": 2},  # groups a version ahead keep generating while each update drains
        sampling={"max_tokens": 40, "temperature": 1.0},
        update={"drain_mode": "abort", "prepare_deadline_s": 60, "drain_deadline_s": 60, "commit_deadline_s": 60},
    )
    events, summary, wall_s = execute(redis_url, run_id, tmp_path, cfg, unwarmed_loop_servers)
    terminal = [e.payload for e in events if e.type in ("RunFinished", "TrainStepRefused", "UpdateAborted")]
    assert summary.status == "completed" and summary.steps == 6, terminal
    report = audit(events)
    assert report.ok, report.render()
    assert_cut_samples_cancelled_only_in_groups_closed_first(events)
    recycled = assert_recycled_across_updates(events, "vllm", max_tokens=40)
    print(f"\nvLLM recycling: {wall_s:.1f} s, {recycled} samples continued across an update")
