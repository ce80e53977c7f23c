"""A trainer killed between writing its staged files and appending UpdateStaged: its restart stages that step again
(content-addressed staging: the same content is a no-op, other content another directory) and appends it once; the
run completes with a clean audit. Before, every restart crashed with "version N: already staged"."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from test_run_loop import execute, small

from rolledger.schemas import events as ev
from rolledger.workers.operator import local_run
from rolledger.workers.runtime.runtime import WorkerKilled
from rolledger.workers.weights.staging_store import DirectoryStagingStore, StagedUpdate
from rolledger.workflows.audit import audit

pytestmark = pytest.mark.slow


class DiesAfterStaging(DirectoryStagingStore):
    """The real store; the trainer dies right after its second version is on disk, before it is in the log."""

    staged: list[StagedUpdate]

    def stage(self, version: int, base_version: int, state_dict: Mapping[str, torch.Tensor], **kw: Any) -> StagedUpdate:
        upd = super().stage(version, base_version, state_dict, **kw)
        self.staged = [*getattr(self, "staged", []), upd]
        if len(self.staged) == 2:
            raise WorkerKilled(f"killed after staging v{version}, before appending UpdateStaged")
        return upd


def test_a_trainer_killed_between_staging_and_appending_restarts_and_stages_once(
    redis_url: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_run, "open_trainer_store", lambda cfg, root: DiesAfterStaging(root))
    events, summary = execute(redis_url, run_id, tmp_path, small())
    assert summary.status == "completed" and summary.steps == 3
    assert "trainer#2" in {e.producer for e in events}  # it died and its restart carried on
    staged = [e.payload for e in events if isinstance(e.payload, ev.UpdateStaged)]
    assert sorted(p.version for p in staged) == [1, 2, 3]  # each version staged once in the log
    steps = [e.payload.step for e in events if isinstance(e.payload, ev.TrainStepFinished)]
    assert steps == [1, 2, 3]
    assert audit(events).ok
    saved = sorted(p.name for p in (tmp_path / run_id / "trainer-state").iterdir())
    assert saved == ["optimizer-v000002.pt", "optimizer-v000003.pt"]  # with each version, the newest two kept


def test_the_optimizer_state_saved_with_a_version_is_what_a_restarted_trainer_resumes(tmp_path: Path) -> None:
    from rolledger.workers.policy.grpo import make_optimizer
    from rolledger.workers.roles.trainer import load_optimizer, save_optimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = make_optimizer(model, 1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    for v in (1, 2, 3):
        save_optimizer(tmp_path, v, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimizer-v000002.pt", "optimizer-v000003.pt"]
    restarted = torch.nn.Linear(4, 3)
    restarted.load_state_dict(model.state_dict())
    resumed = load_optimizer(tmp_path, 3, restarted, 1e-3)
    assert resumed is not None
    want, got = opt.state_dict()["state"], resumed.state_dict()["state"]
    assert want.keys() == got.keys() and all(
        torch.equal(want[k]["exp_avg"], got[k]["exp_avg"]) and torch.equal(want[k]["exp_avg_sq"], got[k]["exp_avg_sq"])
        for k in want
    )
    assert load_optimizer(tmp_path, 1, restarted, 1e-3) is None  # another version's moments would not fit


class DiesOnItsFirstStage(DirectoryStagingStore):
    """The real store; the trainer dies while staging its first version: it has trained step 1 into its model,
    and nothing of that step is in the log."""

    died = False

    def stage(self, version: int, base_version: int, state_dict: Mapping[str, torch.Tensor], **kw: Any) -> StagedUpdate:
        if not DiesOnItsFirstStage.died:
            DiesOnItsFirstStage.died = True
            raise WorkerKilled(f"killed while staging v{version}")
        return super().stage(version, base_version, state_dict, **kw)


def test_a_trainer_respawned_before_its_first_version_trains_from_the_initial_weights_again(
    redis_url: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The respawn shares the dead trainer's model, which holds an unstaged step 1. At v0 the log's weights are the
    model directory's: it loads them back. Before, every respawn refused step 1 on lineage, and the run never ended
    (CI: a trainer that died on a failed append in a Redis Cluster failover)."""
    monkeypatch.setattr(DiesOnItsFirstStage, "died", False)
    monkeypatch.setattr(local_run, "open_trainer_store", lambda cfg, root: DiesOnItsFirstStage(root))
    events, summary = execute(redis_url, run_id, tmp_path, small())
    assert summary.status == "completed" and summary.steps == 3
    assert "trainer#2" in {e.producer for e in events} and "trainer" not in {e.producer for e in events}
    assert [e.payload.step for e in events if isinstance(e.payload, ev.TrainStepFinished)] == [1, 2, 3]
    assert audit(events).ok
