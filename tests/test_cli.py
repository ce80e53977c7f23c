"""The replay/status/audit/lineage commands on a finished run, the way a user reaches them: by run directory,
restarting the run's embedded Redis over its AOF; and `rolledger run` refusing, before anything starts, an
`--inject` that could never fire."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolledger.schemas.config import RunConfig
from rolledger.schemas.injection import check_injections, parse_injection
from rolledger.workers.operator.cli import main
from rolledger.workers.operator.local_run import LocalRun, RunOptions


@pytest.mark.slow
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
    assert main(["lineage", run_dir, "g999999/0"]) == 2  # a trajectory the run does not have: an input error
    assert main(["status", run_dir]) == 0
    out = tmp_path / "t.html"
    assert main(["timeline", run_dir, "--out", str(out)]) == 0 and out.stat().st_size > 0


REFUSED = [
    (["--ranks", "2"], "fail-rank=99@prepare", "rank 99 does not exist"),
    (["--ranks", "2"], "stale-weights=2", "rank 2 does not exist"),
    (["--ranks", "3"], "corrupt-rank=-1", "rank -1 does not exist"),
    ([], "delay-trainer=-1", "finite number of seconds >= 0"),
    ([], "delay-trainer=inf", "finite number of seconds >= 0"),
    ([], "delay-trainer=nan", "finite number of seconds >= 0"),
    ([], "kill-worker=trainer@0", "after N >= 1 units"),
    ([], "kill-worker=rollout@-2", "after N >= 1 units"),
    (["--external-workers"], "kill-worker=reward@3", "starts no reward worker here"),
    (["--external-workers"], "fail-rank=0@commit", "starts no rollout worker here"),
]


@pytest.mark.parametrize(("flags", "spec", "why"), REFUSED)
def test_run_refuses_an_injection_that_cannot_fire_with_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], spec: str, why: str
) -> None:
    runs = tmp_path / "runs"
    fine = [] if "--external-workers" in flags else ["--inject", "fail-rank=0@prepare"]  # the refused one is named
    code = main(["run", *flags, "--runs-dir", str(runs), "--run-id", "x", *fine, "--inject", spec])
    out, err = capsys.readouterr()
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and repr(spec) in lines[0] and why in lines[0], err
    assert "Traceback" not in err and out == ""
    assert not runs.exists()  # refused before anything started: no run directory, no Redis, no model


@pytest.mark.parametrize(("flags", "spec", "why"), REFUSED)
def test_local_run_refuses_it_too_before_creating_the_run(
    tmp_path: Path, flags: list[str], spec: str, why: str
) -> None:
    cfg = RunConfig.model_validate({"ranks": int(flags[1]) if flags[:1] == ["--ranks"] else 1})
    opts = RunOptions(
        config=cfg,
        run_id="x",
        runs_dir=tmp_path / "runs",
        injections=[parse_injection(spec)],
        external_workers="--external-workers" in flags,
    )
    with pytest.raises(ValueError, match=why) as info:
        LocalRun(opts)
    assert repr(spec) in str(info.value)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "spec",
    [
        "fail-rank=0@prepare",
        "fail-rank=3@transfer",
        "fail-rank=3@commit",
        "corrupt-rank=3",
        "stale-weights=0",
        "kill-worker=rollout@1",
        "kill-worker=coordinator@5",
        "kill-worker=trainer",
        "delay-trainer=0",
        "delay-trainer=1.5",
    ],
)
def test_injections_that_can_fire_are_accepted(spec: str) -> None:
    check_injections([parse_injection(spec)], RunConfig.model_validate({"ranks": 4}))
    check_injections([], RunConfig(), in_process=False)  # an external-workers run without faults is fine


def test_timeline_refuses_an_unknown_output_suffix_before_opening_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["timeline", "no-such-run", "--runs-dir", str(tmp_path), "--out", str(tmp_path / "t.pdf")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "t.pdf" in err[0] and ".png or .html" in err[0], err
