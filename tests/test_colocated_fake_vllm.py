"""`rolledger run --engine vllm --mode colocated` against the FAKE vLLM sleep routes (tests/fake_sleep_server.py):
the whole loop (coordinator, a vLLM rank through the real VllmEngine, reward, trainer, all through the log on a real
redis-server) attached to an external server by `vllm_urls`, as a run attaches to a running vLLM. vLLM refuses sleep
mode on CPU, so only the fake can serve a colocated run here; what it generates is the run's own policy in torch,
so the trainer's logprob-agreement gate holds. Each handoff must go sleep -> wake(weights) -> prepare -> commit ->
wake(kv_cache) -> probe on the server, never send what vLLM would crash on, and audit clean."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_sleep_server import FakeVllmSleepServer
from test_run_loop import execute, of

from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.workers.operator.local_run import prepare_policy
from rolledger.workers.policy.policy_model import load_policy
from rolledger.workflows.audit import audit

RUN: dict[str, object] = {
    "engine": "vllm",
    "mode": "colocated",
    "steps": 3,
    "group_size": 4,
    "ranks": 1,
    "trainer": {"warm_start_steps": 20, "groups_per_step": 2},
    "task": {"num_prompts": 64},
    "update": {"prepare_deadline_s": 60, "drain_deadline_s": 60, "commit_deadline_s": 60},
}


@pytest.fixture
def fake_for_run(tmp_path: Path, run_id: str, request: pytest.FixtureRequest) -> Iterator[FakeVllmSleepServer]:
    """A fake server serving the run's initial policy (saved where the run reuses it: runs/<run-id>/model)."""
    model_dir = tmp_path / run_id / "model"
    prepare_policy(RunConfig.model_validate(RUN), model_dir)
    model, tok = load_policy(model_dir)
    server = FakeVllmSleepServer(model, tok, model_dir)
    yield server
    server.close()


@pytest.mark.parametrize("level", [1, 2])
def test_a_colocated_vllm_run_on_the_fake_sleep_routes_completes_every_update_with_a_clean_audit(
    fake_for_run: FakeVllmSleepServer, redis_url: str, run_id: str, tmp_path: Path, level: int
) -> None:
    cfg = RunConfig.model_validate({**RUN, "sleep_level": level, "vllm_urls": [fake_for_run.url]})
    events, summary = execute(redis_url, run_id, tmp_path, cfg, deadline_s=240)
    assert summary.status == "completed" and summary.steps == 3
    report = audit(events)
    assert report.ok, report.render()
    assert sorted(p.version for p in of(events, ev.PolicyPublished)) == [1, 2, 3]
    assert fake_for_run.violations == []
    assert fake_for_run.version == "3"
    # every handoff on the server: sleep at the level, wake the weights (the update), then the KV cache
    handoffs = [fake_for_run.calls[i : i + 3] for i in range(0, len(fake_for_run.calls), 3)]
    assert len(handoffs) == 3
    assert all(
        h == [f"/sleep?level={level}&mode=wait", "/wake_up?tags=weights", "/wake_up?tags=kv_cache"] for h in handoffs
    ), fake_for_run.calls
    woke = [p.tags for p in of(events, ev.EngineWoke)]
    assert woke == [("weights",), ("kv_cache",)] * 3
