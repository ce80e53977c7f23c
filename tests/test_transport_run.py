"""Whole runs over the dist transport (update.transport = "dist"): the trainer serves each version over
torch.distributed/gloo from its own directory, the ranks share nothing with it but loopback. The update transaction
is the transport's contract: the injections abort or commit exactly as over the directory store
(tests/test_run_loop.py), a transfer that moved nothing is caught by the checksums, and a rank quarantined after a
failed commit rejoins on the published version fetched over the network. Staged versions nothing will read again
are collected during the run, so the trainer's directory holds at most three."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_run_loop import execute, of, small

from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.workers.operator import local_run
from rolledger.workers.weights.staging_store import DirectoryStagingStore, StagedUpdate, StagingStore
from rolledger.workers.weights.transport import open_trainer_store
from rolledger.workflows.audit import audit

pytestmark = pytest.mark.slow


def dist(**kw: object) -> RunConfig:
    cfg = small(**kw)
    return cfg.model_copy(update={"update": cfg.update.model_copy(update={"transport": "dist"})})


def test_a_dist_run_learns_its_steps_with_nothing_shared(redis_url: str, run_id: str, tmp_path: Path) -> None:
    events, summary = execute(redis_url, run_id, tmp_path, dist())
    assert summary.status == "completed" and summary.updates_committed == 3
    staged = of(events, ev.UpdateStaged)
    port = of(events, ev.RunStarted)[0].config.update.transport_port
    assert port > 0  # chosen when the run started, recorded in RunStarted: a restarted trainer serves there again
    assert all(u.uri.startswith(f"dist://127.0.0.1:{port}/v00000{u.version}-") for u in staged), staged
    assert [p.version for p in of(events, ev.PolicyPublished)] == [1, 2, 3]
    assert len({p.weights_digest for p in of(events, ev.PolicyPublished)}) == 3
    assert audit(events).ok, audit(events).render()


@pytest.mark.parametrize("phase", ["prepare", "transfer"])
def test_a_rank_failing_before_commit_aborts_everywhere(
    redis_url: str, run_id: str, tmp_path: Path, phase: str
) -> None:
    events, summary = execute(redis_url, run_id, tmp_path, dist(), f"fail-rank=1@{phase}")
    aborted = of(events, ev.UpdateAborted)
    assert len(aborted) == 1 and aborted[0].failed_ranks == (1,)
    assert not [p for p in of(events, ev.RankCommitted) if p.version == aborted[0].version]
    assert summary.updates_committed == 2 and summary.status == "completed" and audit(events).ok


def test_a_transfer_that_moved_nothing_is_caught_and_nothing_commits(
    redis_url: str, run_id: str, tmp_path: Path
) -> None:
    """The hazard vLLM's own code names: a communicator that disabled itself makes every collective a no-op and the
    round "succeeds" while the workers serve stale weights. Here the rank's checksums refuse it."""
    events, summary = execute(redis_url, run_id, tmp_path, dist(), "noop-transport=1")
    failed = of(events, ev.RankPrepareFailed)
    assert len(failed) == 1 and failed[0].rank == 1 and failed[0].tensor
    assert "checksum mismatch after the transfer" in failed[0].reason
    aborted = of(events, ev.UpdateAborted)
    assert len(aborted) == 1 and aborted[0].version == failed[0].version
    assert not [p for p in of(events, ev.RankCommitted) if p.version == failed[0].version]  # rank 0 neither
    assert summary.status == "completed" and audit(events).ok


def test_a_byte_corrupted_in_transit_names_the_tensor(redis_url: str, run_id: str, tmp_path: Path) -> None:
    events, _ = execute(redis_url, run_id, tmp_path, dist(), "corrupt-rank=0")
    failed = of(events, ev.RankPrepareFailed)
    assert len(failed) == 1 and failed[0].rank == 0 and failed[0].tensor and "checksum" in failed[0].reason
    assert len(of(events, ev.UpdateAborted)) == 1 and audit(events).ok


def test_a_quarantined_rank_rejoins_on_the_published_version_over_the_network(
    redis_url: str, run_id: str, tmp_path: Path
) -> None:
    events, summary = execute(redis_url, run_id, tmp_path, dist(), "fail-rank=1@commit")
    q = of(events, ev.RankQuarantined)
    assert q and all(x.rank == 1 for x in q) and "commit failed" in q[0].reason, q
    # rejoined while the next update was already under way without it, it generated nothing until that one was
    # published, and was then sent to reload it (timing decides whether that happens): behind, not failed
    assert all("behind the published" in x.reason for x in q[1:]), q
    # every time it rejoined after a quarantine it did so on a published version, with that version's weights (its
    # last quarantine may come so close to the run's end that it never rejoins: timing again)
    published = {p.version: p.weights_digest for p in of(events, ev.PolicyPublished)}
    rejoins = [p for p in of(events, ev.RankJoined) if p.rank == 1 and p.policy_version > 0]
    assert rejoins, "rank 1 never rejoined on a published version"
    assert all(r.weights_digest == published[r.policy_version] for r in rejoins), rejoins
    assert [r.policy_version for r in rejoins] == [x.version for x in q][: len(rejoins)]  # the version it was sent to
    assert summary.status == "completed" and audit(events).ok


class CountingStore:
    """The run's real trainer store, observed: how many versions it holds right after each stage."""

    def __init__(self, inner: StagingStore) -> None:
        self.inner = inner
        self.held: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def stage(self, *a: object, **kw: object) -> StagedUpdate:
        staged = self.inner.stage(*a, **kw)  # type: ignore[arg-type]
        self.held.append(len(self.inner.versions()))
        return staged


@pytest.mark.parametrize("transport", ["directory", "dist"])
def test_the_trainer_collects_versions_during_the_run(
    redis_url: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    """Before, every version stayed on disk until the run ended (~1 GB per step for a 0.5B bf16 model). Now the
    trainer collects, before staging the next, what no rank or restarted trainer will read: it holds at most the
    published version, its own last one and the new one."""
    stores: list[CountingStore] = []

    def counting(cfg: RunConfig, root: Path) -> StagingStore:
        stores.append(CountingStore(open_trainer_store(cfg, root)))
        return stores[-1]  # type: ignore[return-value]

    monkeypatch.setattr(local_run, "open_trainer_store", counting)
    cfg = small(steps=8, trainer={"warm_start_steps": 5, "groups_per_step": 1})
    cfg = cfg.model_copy(update={"update": cfg.update.model_copy(update={"transport": transport})})
    events, summary = execute(redis_url, run_id, tmp_path, cfg, "fail-rank=1@prepare")
    assert summary.status == "completed" and summary.updates_committed == 7
    assert len(stores) == 1 and len(stores[0].held) == 8
    assert max(stores[0].held) <= 3, stores[0].held
    assert DirectoryStagingStore(tmp_path / run_id / "staging").versions() == [8]
    assert audit(events).ok


def test_a_dist_run_sends_deltas_and_every_rank_commits_the_manifests_bytes(
    redis_url: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With transport_delta every update after the first goes as a delta against the version the ranks serve
    (the first's base is the initial weights, which the trainer never staged: it goes in full). The ranks'
    committed digests equal the manifests' (the audit checks it), so the deltas applied to the right bytes."""
    stores: list[StagingStore] = []

    def keep(cfg: RunConfig, root: Path) -> StagingStore:
        stores.append(open_trainer_store(cfg, root))
        return stores[-1]

    monkeypatch.setattr(local_run, "open_trainer_store", keep)
    cfg = dist(steps=4)
    cfg = cfg.model_copy(update={"update": cfg.update.model_copy(update={"transport_delta": True})})
    events, summary = execute(redis_url, run_id, tmp_path, cfg)
    assert summary.status == "completed" and summary.updates_committed == 4
    server = stores[0].server  # type: ignore[attr-defined]
    assert [(d.version, d.base_version) for d in server.deltas] == [(2, 1), (3, 2), (4, 3)]
    assert all(0 < d.fraction < 1 for d in server.deltas), server.deltas
    committed = {(p.version, p.rank): p.weights_digest for p in of(events, ev.RankCommitted)}
    staged = {u.version: u.weights_digest for u in of(events, ev.UpdateStaged)}
    assert all(digest == staged[v] for (v, _), digest in committed.items()) and len(committed) == 8
    assert audit(events).ok


def test_a_stale_rank_is_still_caught_when_deltas_are_on(redis_url: str, run_id: str, tmp_path: Path) -> None:
    """The stale rank claims v1 but serves v0: the v2 delta against its weights gives the wrong bytes, it fetches the
    full version instead (nothing wrong is committed through the delta), and the probe still quarantines it."""
    cfg = dist(ranks=3)
    cfg = cfg.model_copy(update={"update": cfg.update.model_copy(update={"transport_delta": True})})
    events, summary = execute(redis_url, run_id, tmp_path, cfg, "stale-weights=2")
    q = of(events, ev.RankQuarantined)
    assert q[0].rank == 2 and "probe" in q[0].reason
    # its rejoin (on the version it was quarantined at) may land after the next publish: then it is behind, and
    # quarantined again until it rejoins on that one; never another rank
    assert {x.rank for x in q} == {2} and all("behind the published" in x.reason for x in q[1:])
    assert 2 not in next(p for p in of(events, ev.PolicyPublished) if p.version == q[0].version).ranks
    assert summary.status == "completed"
