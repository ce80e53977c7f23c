"""Processed logprobs against a real vLLM CPU server: `sampling.logprob_mode = "processed"` under temperature 0.7
and top-p 0.9 starts the server with `--logprobs-mode processed_logprobs` (workers.engines.factory), whose logprobs
then come after temperature and top-p (vLLM's TopKTopPSampler); the trainer recomputes them with the same rules
(workers/policy/sampling.py) on its own copy of the weights, and the agreement gate (`trainer.max_logprob_gap`, the
median |trainer - engine| on on-policy tokens, the gate the built-in torch engine passes) must hold on every step
that measured any. One server (one rank), started for this module alone with the mode the run asks for.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from rolledger.schemas import events as ev
from rolledger.workflows.audit import audit

from .conftest import LOOP_CONFIG, LoopServers, started_loop_servers
from .test_vllm_loop import execute, of

pytestmark = pytest.mark.vllm

PROCESSED: dict[str, object] = {
    **LOOP_CONFIG,
    "ranks": 1,
    "sampling": {"temperature": 0.7, "top_p": 0.9, "max_tokens": 16, "logprob_mode": "processed"},
}


@pytest.fixture(scope="module")
def processed_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopServers]:
    with started_loop_servers(tmp_path_factory, "vllm_processed", PROCESSED) as servers:
        yield servers


def test_processed_logprobs_under_temperature_and_top_p_agree_with_the_trainer(
    processed_servers: LoopServers, redis_url: str, run_id: str, tmp_path: Path
) -> None:
    cfg = processed_servers.config(**{k: v for k, v in PROCESSED.items() if k != "engine"})
    assert cfg.sampling.logprob_mode == "processed" and cfg.sampling.temperature == 0.7 and cfg.sampling.top_p == 0.9
    events, summary, wall_s = execute(redis_url, run_id, tmp_path, cfg, processed_servers)
    assert summary.status == "completed" and summary.steps == 3
    report = audit(events)
    assert report.ok, report.render()
    finished = [p.trajectory for p in of(events, ev.SampleFinished)]
    assert finished and all(t.sampling.logprob_mode == "processed" for t in finished)
    steps = of(events, ev.TrainStepFinished)
    measured = [s for s in steps if s.agreement_tokens > 0]
    assert measured, [(s.step, s.agreement_tokens) for s in steps]
    bound = cfg.trainer.max_logprob_gap
    medians = [s.logprob_gap_median for s in measured]
    assert all(m < bound for m in medians), (medians, bound)
    print(
        f"\nvLLM processed logprobs (T=0.7, top-p 0.9): {wall_s:.1f} s, {len(finished)} samples; median gap per "
        f"measured step {[f'{m:.2e}' for m in medians]} (p99 {[f'{s.logprob_gap_p99:.2e}' for s in measured]}, "
        f"tokens {[s.agreement_tokens for s in measured]}; gate {bound:g}); median {statistics.median(medians):.2e}"
    )
