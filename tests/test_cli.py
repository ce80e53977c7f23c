"""The replay/status/audit/lineage commands on a finished run, the way a user reaches them: by run directory,
restarting the run's embedded Redis over its AOF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolledger.schemas.config import RunConfig
from rolledger.workers.cli import main
from rolledger.workers.local_run import LocalRun, RunOptions

pytestmark = pytest.mark.slow


def test_commands_reopen_a_finished_embedded_run_from_its_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = RunConfig.model_validate(
        {
            "steps": 2,
            "group_size": 4,
            "trainer": {"warm_start_steps": 10, "groups_per_step": 2},
            "task": {"num_prompts": 16},
        }
    )
    run = LocalRun(RunOptions(config=cfg, run_id="emb", runs_dir=tmp_path))  # no Redis URL: the embedded server
    assert run.execute().status == "completed"
    run_dir = str(tmp_path / "emb")
    capsys.readouterr()
    assert main(["replay", run_dir, "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["deterministic"] and replayed["snapshot_plus_tail"] == replayed["digest"]
    assert replayed["snapshots"] and all(s["ok"] for s in replayed["snapshots"])
    assert main(["audit", run_dir, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main(["lineage", run_dir, "g000000/0", "--json"]) == 0
    chain = json.loads(capsys.readouterr().out)
    assert chain["trajectory_id"] == "g000000/0" and chain["sample"]["policy_version"] == 0
    assert main(["lineage", run_dir, "g999999/0"]) == 1
    assert main(["status", run_dir]) == 0
    out = tmp_path / "t.html"
    assert main(["timeline", run_dir, "--out", str(out)]) == 0 and out.stat().st_size > 0
