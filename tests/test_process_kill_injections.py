"""The dist transport's process kills (issue 39): `kill-trainer@copy` (the trainer dies between writing its durable
copy of a version and the weight server's record that the copy is in place) and `kill-rank=R@receive` (a rank dies
while it receives a version's buckets). Their specs and one-line refusals; the two points they fire at, in this
process against a real WeightServer; and a real distributed run (the chaos harness: a redis-server, a process per
worker, a supervisor that restarts what dies) with each, which recovers and audits clean."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from chaos.harness import prepare_model, run_schedule  # tests/chaos (tests/ is on pytest's pythonpath)
from chaos.schedule import Schedule

from rolledger.schemas.config import RunConfig
from rolledger.schemas.injection import check_injections, parse_injection
from rolledger.workers.weights import transport_dist_receive
from rolledger.workers.weights.transport import DistStagingStore
from rolledger.workers.weights.transport_dist_receive import receive_verified


def _dist(**update: object) -> RunConfig:
    return RunConfig.model_validate({"ranks": 2, "update": {"transport": "dist", **update}})


def test_the_specs_parse_and_render_back() -> None:
    kill = parse_injection("kill-trainer@copy")
    assert (kill.kind, kill.spec, kill.fired_by) == ("kill-trainer", "kill-trainer@copy", "trainer")
    rank = parse_injection("kill-rank=1@receive")
    assert (rank.kind, rank.rank, rank.spec, rank.fired_by) == ("kill-rank", 1, "kill-rank=1@receive", "rollout")
    for bad, why in [
        ("kill-trainer", "expected kill-trainer@copy"),
        ("kill-trainer@send", "expected kill-trainer@copy"),
        ("kill-trainer=1@copy", "expected kill-trainer@copy"),
        ("kill-rank=1", "expected kill-rank=R@receive"),
        ("kill-rank=x@receive", "invalid literal"),
        ("kill-rank@receive", "expected KIND=VALUE"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_injection(bad)


@pytest.mark.parametrize(
    ("spec", "cfg", "in_process", "why"),
    [
        ("kill-trainer@copy", RunConfig.model_validate({"ranks": 2}), True, "update.transport is directory"),
        ("kill-rank=0@receive", RunConfig.model_validate({"ranks": 2}), True, "update.transport is directory"),
        ("kill-rank=2@receive", _dist(), True, "rank 2 does not exist"),
        ("kill-trainer@copy", _dist(), True, "SIGKILLs the trainer's process"),
        ("kill-rank=1@receive", _dist(), True, "SIGKILLs the rank's process"),
        ("kill-trainer@copy", _dist(), False, "starts no trainer worker here"),
    ],
)
def test_each_is_refused_in_one_line_where_it_cannot_fire(
    spec: str, cfg: RunConfig, in_process: bool, why: str
) -> None:
    with pytest.raises(ValueError, match=why) as info:
        check_injections([parse_injection(spec)], cfg, in_process=in_process)
    assert repr(spec) in str(info.value) and "\n" not in str(info.value)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.randn(32, generator=g)}


def test_the_copy_hook_runs_after_the_copy_is_written_and_before_the_server_records_it(tmp_path: Path) -> None:
    store = DistStagingStore(tmp_path / "trainer", "127.0.0.1", 0, timeout_s=60, fsync=False)
    seen: list[tuple[int, bool, bool]] = []

    def copied(version: int) -> None:
        [directory] = [p for p in store.root.iterdir() if p.name.startswith(f"v{version:06d}")]
        held = store.server._held[directory.name]
        seen.append((version, (directory / "manifest.json").is_file(), held.durable.is_set()))

    store.on_copied = copied
    try:
        staged = store.stage(1, 0, _state())
        store.wait_persisted()
        got = receive_verified(staged.uri, 1, staged.manifest, timeout_s=60)  # recorded after the hook: it goes
    finally:
        store.close()
    assert seen == [(1, True, False)]  # the copy on disk, the server not yet told
    assert torch.equal(got["a.weight"], _state()["a.weight"])


def test_the_receive_hook_runs_once_per_bucket_received(tmp_path: Path) -> None:
    store = DistStagingStore(tmp_path / "trainer", "127.0.0.1", 0, timeout_s=60, fsync=False, bucket_bytes=1000)
    tags: list[int] = []
    transport_dist_receive.on_bucket_received = tags.append
    try:
        staged = store.stage(1, 0, _state())
        receive_verified(staged.uri, 1, staged.manifest, timeout_s=60)
    finally:
        transport_dist_receive.on_bucket_received = None
        store.close()
    nbytes = sum(t.numel() * t.element_size() for t in _state().values())
    assert tags == list(range(-(-nbytes // 1000)))  # every bucket, in order


# ---------------------------------------------------------------- a real distributed run with each
@pytest.mark.parametrize(
    ("proc", "spec"), [("trainer", "kill-trainer@copy"), ("rank1", "kill-rank=1@receive")], ids=["trainer", "rank"]
)
def test_a_run_recovers_from_the_kill_and_audits_clean(tmp_path: Path, proc: str, spec: str) -> None:
    schedule = Schedule.from_json(
        '{"seed":9001,"steps":3,"group_size":2,"groups_per_step":1,"coordinators":1,'
        f'"faults":["after:GroupCompleted#1 -> inject:{proc}:{spec}"],"transport":"dist","rollout":"plain"}}'
    )
    result = run_schedule(schedule, tmp_path / "s", prepare_model(tmp_path / "model"), keep=True)
    v = result.verdict
    assert result.faults_fired == [f"inject {spec}"], result.to_dict()
    assert any(c.startswith(f"{proc}.1 exited -9") for c in result.crashes), result.crashes  # SIGKILLed, restarted
    assert v.ok, v.violations  # the checks include workflows.audit over the whole log, and no acknowledged id lost
    assert str(v.ending) == "finished", (v.ending, v.reason)
