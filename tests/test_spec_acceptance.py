"""Seed 004's last level-2 rule: after each update a rank reads its speculative draft's acceptance counters and
records them in HealthPassed, and the probe fails when the acceptance on the new weights fell past
`update.max_spec_acceptance_drop` (workflows/health.py). The counters are vLLM's Prometheus counters
(workers/engines/spec_counters.py), served here by the FAKE vLLM server (tests/fake_sleep_server.py), which counts
drafted and accepted tokens per generated token at the acceptance a test sets (it runs no draft model: vLLM on CPU
cannot run one here). The whole loop runs against it through the real VllmEngine and RankWorker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_sleep_server import FakeVllmSleepServer
from test_run_loop import execute, of

from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.workers.engines.spec_counters import SpecCounters, acceptance, read_spec_counters
from rolledger.workers.operator.local_run import prepare_policy
from rolledger.workers.policy.policy_model import load_policy
from rolledger.workflows.audit import audit
from rolledger.workflows.health import acceptance_drop

DRAFT = {"speculative_config": {"method": "eagle", "model": "draft-1", "num_speculative_tokens": 3}}

# the shape vLLM 0.32's /metrics gives them: HELP/TYPE lines, one sample per engine, a _created gauge beside each
VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 40.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 120.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 80.0
vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 90.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 60.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_the_counters_are_summed_over_engines_and_absent_without_a_draft() -> None:
    assert read_spec_counters(VLLM_METRICS) == SpecCounters(drafted=200.0, accepted=150.0)
    assert read_spec_counters("# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n") is None
    assert read_spec_counters("") is None


def test_acceptance_is_over_the_window_between_two_readings() -> None:
    a, b = SpecCounters(200.0, 150.0), SpecCounters(300.0, 170.0)
    assert acceptance(None, a) == 0.75  # from the server's start
    assert acceptance(a, b) == pytest.approx(0.2)
    assert acceptance(b, b) is None  # nothing drafted in between: nothing measured
    assert acceptance(a, None) is None
    assert acceptance(b, SpecCounters(10.0, 9.0)) == pytest.approx(0.9)  # the server restarted: counts from zero


def test_the_verdict_fails_a_drop_past_the_threshold_only() -> None:
    assert acceptance_drop(0.8, 0.5, 0.5) == ""  # 0.5 >= 0.4
    why = acceptance_drop(0.8, 0.2, 0.5)
    assert "fell from 0.80 to 0.20" in why and "max_spec_acceptance_drop = 0.5" in why
    assert acceptance_drop(0.8, 0.0, 1.0) == ""  # 1 never fails
    assert acceptance_drop(None, 0.1, 0.5) == acceptance_drop(0.8, None, 0.5) == ""  # nothing to compare


RUN: dict[str, object] = {
    "engine": "vllm",
    "steps": 2,
    "group_size": 4,
    "ranks": 1,
    "trainer": {"warm_start_steps": 20, "groups_per_step": 2},
    "task": {"num_prompts": 64},
    "update": {"prepare_deadline_s": 60, "drain_deadline_s": 60, "commit_deadline_s": 60},
}


@pytest.fixture
def drafting_fake(tmp_path: Path, run_id: str) -> Iterator[FakeVllmSleepServer]:
    """A fake vLLM server with a speculative draft, serving the run's initial policy (runs/<run-id>/model)."""
    model_dir = tmp_path / run_id / "model"
    prepare_policy(RunConfig.model_validate(RUN), model_dir)
    model, tok = load_policy(model_dir)
    server = FakeVllmSleepServer(model, tok, model_dir, server_config=DRAFT)
    yield server
    server.close()


def _run(server: FakeVllmSleepServer, redis_url: str, run_id: str, tmp_path: Path, **extra: Any) -> list[ev.Event]:
    cfg = RunConfig.model_validate({**RUN, **extra, "vllm_urls": [server.url]})
    events, _ = execute(redis_url, run_id, tmp_path, cfg, deadline_s=240)
    return events


def test_every_update_records_the_drafts_acceptance_before_and_after(
    drafting_fake: FakeVllmSleepServer, redis_url: str, run_id: str, tmp_path: Path
) -> None:
    events = _run(drafting_fake, redis_url, run_id, tmp_path)
    assert of(events, ev.RunFinished)[0].status == "completed"
    health = of(events, ev.HealthPassed)
    assert sorted(h.version for h in health) == [1, 2]
    served = {s.trajectory.policy_version for s in of(events, ev.SampleFinished)}
    for h in health:  # the fake accepts 0.8 of what is drafted
        assert h.spec_acceptance_rate == pytest.approx(0.8), h
        # the window before the commit is what the previous version served after its own probe. Version 0 served
        # step 1's samples; version 1 may have served none before the update to 2 drained it (step 2 can train on
        # version 0's samples within the staleness bound), and then nothing was measured: None, not a made-up rate
        if h.version - 1 in served:
            assert h.spec_acceptance_before == pytest.approx(0.8), h
        else:
            assert h.spec_acceptance_before is None, h
    assert 0 in served
    report = audit(events)
    assert report.ok, report.render()


def test_a_draft_that_no_longer_matches_the_new_weights_fails_their_probe(
    drafting_fake: FakeVllmSleepServer, redis_url: str, run_id: str, tmp_path: Path
) -> None:
    drafting_fake.acceptance_by_version = {"1": 0.1}  # what the draft achieves against v1's weights
    events = _run(drafting_fake, redis_url, run_id, tmp_path, steps=1)
    failed = [h for h in of(events, ev.HealthFailed) if h.version == 1]
    assert failed, [e.type for e in events]
    assert "speculative acceptance fell from 0.80 to 0.10" in failed[0].reason, failed[0].reason
    assert not [h for h in of(events, ev.HealthPassed) if h.version == 1]
    assert 1 in [q.version for q in of(events, ev.RankQuarantined)]  # a rank failing its probe after the commit
