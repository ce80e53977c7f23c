"""The rank-side faults as an engine wrapper (workers/operator/faults.py FaultyEngine) around a real TorchEngine and a real
staging store: each fires once, through the normal paths; and a rollout killed mid-group in a real run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_run_loop import execute, of, small

from rolledger.schemas import events as ev
from rolledger.schemas.config import ModelConfig, SamplingParams
from rolledger.schemas.injection import parse_injection
from rolledger.workers.engines.protocol import Engine, EngineError
from rolledger.workers.engines.torch_engine import TorchEngine
from rolledger.workers.operator.faults import FaultyEngine, Injector, wrap_engine
from rolledger.workers.policy.policy_model import build_model, build_tokenizer, policy_state
from rolledger.workers.runtime.runtime import WorkerKilled
from rolledger.workers.weights.staging_format import StagingError
from rolledger.workers.weights.staging_store import DirectoryStagingStore, StagedUpdate, read_manifest

SAMPLING = SamplingParams(temperature=1.0, max_tokens=4, seed=3)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def setup(tmp_path: Path, *specs: str) -> tuple[TorchEngine, FaultyEngine, StagedUpdate, list[int]]:
    tok = build_tokenizer()
    engine = TorchEngine(build_model(ModelConfig(), len(tok), 0), tok, rank=0)
    staged = DirectoryStagingStore(tmp_path / "staging").stage(
        1, 0, policy_state(build_model(ModelConfig(), len(tok), 1))
    )
    faulty = FaultyEngine(engine, 0, Injector([parse_injection(s) for s in specs]))
    return engine, faulty, staged, list(tok("23+19=")["input_ids"])


def prepare(e: Engine, staged: StagedUpdate) -> str:
    return e.prepare(1, staged.uri, read_manifest(staged.uri, 1, expected_digest=staged.manifest_digest))


def test_wrapping_happens_only_for_this_ranks_injections(tmp_path: Path) -> None:
    engine, _, _, _ = setup(tmp_path)
    assert wrap_engine(engine, 0, Injector([parse_injection("fail-rank=1@commit")])) is engine
    assert isinstance(wrap_engine(engine, 1, Injector([parse_injection("fail-rank=1@commit")])), FaultyEngine)
    assert isinstance(wrap_engine(engine, 0, Injector([parse_injection("kill-worker=rollout@2")])), FaultyEngine)
    assert isinstance(wrap_engine(engine, 0, Injector([parse_injection("stale-weights=0")])), Engine)


@pytest.mark.parametrize(
    ("spec", "error", "kind"),
    [("fail-rank=0@prepare", EngineError, None), ("fail-rank=0@transfer", StagingError, "unreadable")],
)
def test_a_failing_prepare_fires_once_and_leaves_the_live_weights(
    tmp_path: Path, spec: str, error: type[Exception], kind: str | None
) -> None:
    engine, faulty, staged, _ = setup(tmp_path, spec)
    live = engine.weights_digest()
    with pytest.raises(error, match="injected") as info:
        prepare(faulty, staged)
    assert getattr(info.value, "kind", None) == kind
    assert engine.weights_digest() == live and engine.staged_version is None
    assert prepare(faulty, staged) == staged.manifest.weights_digest  # once: the next prepare is real


def test_a_corrupt_transfer_is_caught_by_the_verified_path_naming_the_tensor(tmp_path: Path) -> None:
    engine, faulty, staged, _ = setup(tmp_path, "corrupt-rank=0")
    with pytest.raises(StagingError, match="checksum") as info:
        prepare(faulty, staged)
    assert info.value.tensor == staged.manifest.tensors[0].name
    assert engine.staged_version is None


def test_a_failing_commit_drops_the_staged_weights(tmp_path: Path) -> None:
    engine, faulty, staged, _ = setup(tmp_path, "fail-rank=0@commit")
    prepare(faulty, staged)
    with pytest.raises(EngineError, match="injected fail-rank=0@commit"):
        faulty.commit_weights(1)
    assert engine.staged_version is None and engine.policy_version == 0


def test_stale_weights_claim_the_new_version_and_keep_serving_the_old(tmp_path: Path) -> None:
    engine, faulty, staged, ids = setup(tmp_path, "stale-weights=0")
    old = engine.weights_digest()
    old_tokens = [s.token_ids for s in engine.generate(ids, 2, SAMPLING).samples]
    prepare(faulty, staged)
    report = faulty.commit_weights(1)
    want = staged.manifest.weights_digest
    assert (report.policy_version, report.weights_digest) == (1, want)  # what the manifest says
    assert (faulty.policy_version, faulty.weights_digest()) == (1, want)
    assert engine.weights_digest() == old and engine.policy_version == 0  # what it really serves
    out = faulty.generate(ids, 2, SAMPLING)
    assert (out.policy_version, out.weights_digest) == (1, want)  # every stamp claims the new version
    assert [s.token_ids for s in out.samples] == old_tokens  # produced by the old weights
    tok = build_tokenizer()
    honest = TorchEngine(build_model(ModelConfig(), len(tok), 1), tok, rank=1)
    assert faulty.health().probe_digest != honest.health().probe_digest  # the probe shows the old weights
    # the next real commit (a rejoin through the verified path) ends the lie
    prepare(faulty, staged)
    assert faulty.commit_weights(1).weights_digest == want == engine.weights_digest() == honest.weights_digest()
    assert faulty.health().probe_digest == honest.health().probe_digest


def test_a_killed_rollout_dies_at_the_start_of_its_nth_group(tmp_path: Path) -> None:
    _, faulty, _, ids = setup(tmp_path, "kill-worker=rollout@2")
    faulty.generate(ids, 2, SAMPLING)
    with pytest.raises(WorkerKilled):
        faulty.generate(ids, 2, SAMPLING)
    faulty.generate(ids, 2, SAMPLING)  # once


@pytest.mark.slow
def test_a_rollout_killed_mid_group_is_replaced_and_its_orphans_are_closed(
    redis_url: str, run_id: str, tmp_path: Path
) -> None:
    events, summary = execute(redis_url, run_id, tmp_path, small(), "kill-worker=rollout@2")
    assert summary.status == "completed"
    lost = [p for p in of(events, ev.SampleFailed) if "worker lost" in p.error]
    assert lost  # the reclaiming consumer closed what the killed one had started
    ends = [
        p.trajectory.trajectory_id if isinstance(p, ev.SampleFinished) else p.sample_id
        for p in (e.payload for e in events)
        if isinstance(p, (ev.SampleFinished, ev.SampleCancelled, ev.SampleFailed))
    ]
    assert len(ends) == len(set(ends)) == len(of(events, ev.SampleStarted))  # every sample ends exactly once
