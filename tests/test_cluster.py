"""Runs on a real Redis Cluster (tests/redis_cluster.py: 3 primaries with one replica each, on loopback).

What is checked: a `redis+cluster://` URL gives a cluster client; every key a run touches sits on its one hash slot
(asked of the cluster itself, not computed here); the project's Lua scripts and a MULTI block run there; two runs at
once finish, audit clean and sit on different primaries; a run survives a coordinated failover of its primary."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from audit_check import audited_clean
from redis_cluster import RedisClusterProcesses

from rolledger.events import keys
from rolledger.events.cluster import ClusterClient
from rolledger.events.connection import cluster_nodes, connect
from rolledger.events.consumer import GroupConsumer
from rolledger.events.lease import LeaderLease
from rolledger.events.snapshots import latest_snapshot, take_snapshot
from rolledger.events.store import ConcurrencyConflict, EventLog, dead_letter, read_dead_letters
from rolledger.events.work import GROUPS as WORK_GROUPS
from rolledger.schemas import events as ev

CONFIG = """
steps = 3
group_size = 4
ranks = 2
[trainer]
warm_start_steps = 20
groups_per_step = 2
[task]
num_prompts = 64
[update]
prepare_deadline_s = 20
drain_deadline_s = 20
commit_deadline_s = 20
"""


# ------------------------------------------------------------------ URL parsing (no server)
def test_a_cluster_url_names_its_startup_nodes_and_is_refused_with_a_reason_when_malformed() -> None:
    assert cluster_nodes("redis+cluster://10.0.0.1:7000,10.0.0.2:7001") == [("10.0.0.1", 7000), ("10.0.0.2", 7001)]
    assert cluster_nodes("rediss+cluster://u:pw@h:7000/") == [("h", 7000)]
    assert cluster_nodes("redis+cluster://[::1]:7000") == [("::1", 7000)]
    for bad, says in [
        ("redis+cluster://h:7000/2", "no database"),
        ("redis+cluster://h", "not host:port"),
        ("redis+cluster://h:7000,h2", "not host:port"),
        ("redis+cluster://h:99999", "not host:port"),
    ]:
        with pytest.raises(ValueError, match=says):
            connect(bad)
    with pytest.raises(ValueError, match="tls_ca given but .* not rediss"):
        connect("redis+cluster://h:7000", tls_ca="/ca.pem")
    with pytest.raises(ValueError, match=r"\*\*\*"):  # the password never shows in the message
        connect("redis+cluster://u:secret@h:7000/3")


def test_a_single_server_named_as_a_cluster_is_refused_with_a_reason(redis_server: object) -> None:
    port = redis_server.port  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="not a cluster node"):
        connect(f"redis+cluster://127.0.0.1:{port}", retry_deadline=5.0)


# ------------------------------------------------------------------ one run's keys, scripts, transactions
@pytest.fixture
def cluster_client(redis_cluster: RedisClusterProcesses) -> ClusterClient:
    client = connect(redis_cluster.url)
    assert isinstance(client, ClusterClient)
    return client


def _slot(cluster: RedisClusterProcesses, key: str) -> int:
    node = cluster.node(cluster.ports[0])
    try:
        return int(node.execute_command("CLUSTER", "KEYSLOT", key))
    finally:
        node.close()


def test_a_script_runs_on_a_node_whose_script_cache_is_empty_even_if_script_load_went_elsewhere(
    redis_cluster: RedisClusterProcesses, cluster_client: ClusterClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failover the promoted replica has no scripts, and the client's SCRIPT LOAD may go to the nodes of a
    layout it has not refreshed yet (CI: the trainer died on a second NOSCRIPT, then a run hung). Here every
    node's cache is flushed and SCRIPT LOAD is made to reach no node, which stands for that stale layout: the script
    still runs, sent whole with EVAL to the node serving its key."""
    key = f"{{t-{uuid.uuid4().hex[:8]}}}:n"
    script = cluster_client.register_script("return redis.call('INCR', KEYS[1])")
    assert script(keys=[key]) == 1
    for port in redis_cluster.ports:
        node = redis_cluster.node(port)
        try:
            node.execute_command("SCRIPT", "FLUSH")
        finally:
            node.close()
    monkeypatch.setattr(cluster_client, "script_load", lambda body: script.sha)  # loaded nowhere
    try:
        assert script(keys=[key]) == 2
        node = redis_cluster.node(redis_cluster.primary_of(key))
        try:
            assert node.execute_command("SCRIPT", "EXISTS", script.sha) == [1]  # EVAL cached it where the key lives
        finally:
            node.close()
    finally:
        cluster_client.delete(key)  # the cluster is shared: leave no key outside a run's hash tag


def test_every_key_name_of_a_run_hashes_to_the_runs_one_slot(redis_cluster: RedisClusterProcesses) -> None:
    run = f"c-{uuid.uuid4().hex[:8]}"
    names = [
        keys.log_key(run),
        keys.dead_letter_key(run),
        keys.dead_letter_seen_key(run),
        keys.dedupe_key(run),
        keys.snapshots_key(run),
        keys.lease_key(run, "coordinator"),
        keys.fence_key(run, "coordinator"),
        keys.archive_key(run),
        *(keys.work_key(run, g) for g in WORK_GROUPS),
    ]
    assert {_slot(redis_cluster, k) for k in names} == {_slot(redis_cluster, "{" + run + "}")}


def test_the_logs_scripts_leases_groups_and_a_multi_block_work_on_a_cluster(
    redis_cluster: RedisClusterProcesses, cluster_client: ClusterClient
) -> None:
    """Every Lua script of the project (appends, dead letters, snapshots, leases, the consumer's refresh) runs on the
    primary of the run's slot; after SCRIPT FLUSH on every node they are loaded again; a MULTI block of run keys
    commits as one."""
    from logbuilder import LogBuilder

    client: redis.Redis = cluster_client  # type: ignore[assignment]
    run = f"c-{uuid.uuid4().hex[:8]}"
    log = EventLog(client, run)
    evs = LogBuilder().start_run().group().build()  # distinct event ids
    first = log.append_many(evs[:1])
    assert log.append_many(evs[:1]) == first  # deduped by event id
    with pytest.raises(ConcurrencyConflict):
        log.append_if(evs[1:2], expected_last_id=None)
    log.append_if(evs[1:2], expected_last_id=first[0])
    assert log.append_once(evs[2:3], ["stage:v1"]) is not None
    assert log.append_once(evs[3:4], ["stage:v1"]) is None
    assert [s.event.event_id for s in log.read()] == [e.event_id for e in evs[:3]]
    assert log.wait_durable(timeout_ms=2000) is True  # the nodes run with appendonly yes

    for port in redis_cluster.ports:  # NOSCRIPT everywhere: redis-py loads the script again
        node = redis_cluster.node(port)
        node.script_flush()
        node.close()
    log.append_many(evs[3:4])
    assert log.length() == 4

    assert dead_letter(client, run, stream_id="1-1", raw=b"x", reason="bad", consumer="t") == dead_letter(
        client, run, stream_id="1-1", raw=b"x", reason="bad", consumer="t"
    )
    assert [d.reason for d in read_dead_letters(client, run)] == ["bad"]

    lease = LeaderLease(client, run, "coordinator", "me", ttl_ms=5000)
    other = LeaderLease(client, run, "coordinator", "them", ttl_ms=5000)
    assert lease.acquire() == 1 and other.acquire() is None and lease.renew()
    lease.release()
    assert other.acquire() == 2 and other.current_token() == 2

    group = GroupConsumer(client, run, "g", "c1", claim_idle_ms=60_000)
    group.ensure_group()
    got = group.read(count=10, block_ms=100)
    assert [d.event.event_id for d in got] == [e.event_id for e in evs[:4]]
    assert group.refresh(*(d.stream_id for d in got)) == {d.stream_id for d in got}
    group.ack(*(d.stream_id for d in got))
    work = GroupConsumer.work(client, run, "rollout", "r1")  # a work stream: written by the append scripts above
    work.ensure_group()
    got = work.read(count=10, block_ms=100)
    assert [d.event.event_id for d in got] == [e.event_id for e in evs[:4] if e.type == "GroupAdmitted"]
    work.ack(*(d.stream_id for d in got))  # XACK + XDEL in one script call on the run's slot
    assert client.xlen(keys.work_key(run, "rollout")) == 0 and work.pending() == 0

    class _State:
        last_event_id = "e"

        def digest(self) -> str:
            return "d"

        def to_dict(self) -> dict[str, object]:
            return {"a": 1}

    take_snapshot(client, run, _State(), first[0])
    snap = latest_snapshot(client, run)
    assert snap is not None and snap.state_dict() == {"a": 1}

    pipe = cluster_client.pipeline(transaction=True)
    pipe.set(keys.fence_key(run, "probe") + ":set", b"1")
    pipe.incr(keys.fence_key(run, "probe"))
    assert pipe.execute()[1] == 1  # MULTI ... EXEC on the run's primary
    assert client.get(keys.fence_key(run, "probe") + ":set") == b"1"

    primary = redis_cluster.primary_of(keys.log_key(run))
    on_primary = redis_cluster.node(primary)
    try:
        touched = {k.decode() for k in on_primary.scan_iter(match=f"*{{{run}}}*", count=1000)}
    finally:
        on_primary.close()
    assert touched == {
        keys.log_key(run),
        keys.dedupe_key(run),
        keys.dead_letter_key(run),
        keys.dead_letter_seen_key(run),
        keys.snapshots_key(run),
        keys.lease_key(run, "coordinator"),
        keys.fence_key(run, "coordinator"),
        keys.fence_key(run, "probe"),
        keys.fence_key(run, "probe") + ":set",
        keys.work_key(run, "rollout"),  # the GroupAdmitted's work stream, empty once acknowledged, with its group
    }
    for port in redis_cluster.ports:  # nothing of the run anywhere else (replicas answer SCAN with their copy)
        if port == primary or port == redis_cluster.replica_of(primary):
            continue
        node = redis_cluster.node(port)
        try:
            assert list(node.scan_iter(match=f"*{run}*", count=1000)) == [], port
        finally:
            node.close()


# ------------------------------------------------------------------ whole runs
def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "rolledger.workers.operator.cli", "--json-logs", *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def _runs_on_distinct_primaries(cluster: RedisClusterProcesses, n: int) -> list[str]:
    """n fresh run ids whose slots are served by n different primaries (as the cluster says)."""
    chosen: dict[int, str] = {}
    while len(chosen) < n:
        run = f"c-{uuid.uuid4().hex[:8]}"
        chosen.setdefault(cluster.primary_of(keys.log_key(run)), run)
    return list(chosen.values())


def _audit_clean(url: str, run: str, tmp_path: Path) -> list[ev.Event]:
    """The CLI's `rolledger audit` passes (exit 0) and so does the audit function over the log read back."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rolledger.workers.operator.cli",
            "audit",
            run,
            "--redis",
            url,
            "--runs-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    client = connect(url)
    try:
        return audited_clean(EventLog(client, run).read())
    finally:
        client.close()


@pytest.mark.slow
def test_two_runs_at_once_finish_audit_clean_and_sit_on_different_shards(
    redis_cluster: RedisClusterProcesses, tmp_path: Path
) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(CONFIG)
    runs = _runs_on_distinct_primaries(redis_cluster, 2)
    procs = {
        run: _spawn(
            ["run", "--redis", redis_cluster.url, "--run-id", run, "--config", str(cfg), "--runs-dir", str(tmp_path)],
            tmp_path / f"{run}.log",
        )
        for run in runs
    }
    try:
        for run, p in procs.items():
            assert p.wait(timeout=400) == 0, (tmp_path / f"{run}.log").read_text()[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for run in runs:
        events = _audit_clean(redis_cluster.url, run, tmp_path)
        assert any(isinstance(e.payload, ev.RunFinished) and e.payload.status == "completed" for e in events)
    # without --redis the run directory's redis_url (the cluster URL) is where the log is read
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "rolledger.workers.operator.cli", "audit", runs[0], "--runs-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    # where the runs' keys are, asked of each primary: each run's keys on one primary, the two primaries differ
    # (keys on a replica are copies of its primary's, so primaries are enough)
    holders: dict[str, set[int]] = {run: set() for run in runs}
    for port in redis_cluster.ports:
        node = redis_cluster.node(port)
        try:
            if node.execute_command("ROLE")[0] != b"master":
                continue
            for raw in node.scan_iter(count=1000):  # every key of the cluster is some run's, in its hash tag
                tag = re.fullmatch(r"rolledger:\{([^{}]+)\}:.+", raw.decode())
                assert tag is not None, f"a key outside any run's hash tag: {raw!r}"
                if tag.group(1) in holders:
                    holders[tag.group(1)].add(port)
        finally:
            node.close()
    assert all(len(ports) == 1 for ports in holders.values()), holders
    assert holders[runs[0]] != holders[runs[1]], holders


@pytest.mark.slow
def test_a_run_survives_a_coordinated_failover_of_its_primary(
    redis_cluster: RedisClusterProcesses, tmp_path: Path
) -> None:
    """`CLUSTER FAILOVER` on the replica of the run's primary, mid-run: the replica takes over only once it has every
    write of its primary, so nothing acknowledged is lost; clients follow the MOVED replies and blocked reads that
    the role change cut short are retried. (An uncoordinated failover, the primary killed, can lose acknowledged
    writes: replication is asynchronous; see docs/durability.md.)"""
    cfg = tmp_path / "run.toml"
    cfg.write_text(CONFIG)
    run = f"c-{uuid.uuid4().hex[:8]}"
    primary = redis_cluster.primary_of(keys.log_key(run))
    replica = redis_cluster.replica_of(primary)
    assert replica, f"the run's primary {primary} has no replica"
    proc = _spawn(
        ["run", "--redis", redis_cluster.url, "--run-id", run, "--config", str(cfg), "--runs-dir", str(tmp_path)],
        tmp_path / "run.log",
    )
    client = connect(redis_cluster.url)
    try:
        log = EventLog(client, run)
        deadline = time.monotonic() + 240
        while not any(isinstance(s.event.payload, ev.SampleFinished) for s in log.read()):
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no SampleFinished within 240 s"
            time.sleep(0.2)  # polling the log with a deadline
        before = log.length()
        node = redis_cluster.node(replica)
        try:
            assert node.execute_command("CLUSTER", "FAILOVER") == b"OK"
        finally:
            node.close()
        deadline = time.monotonic() + 60
        while redis_cluster.primary_of(keys.log_key(run)) != replica:
            assert time.monotonic() < deadline, "the replica did not take over within 60 s"
            time.sleep(0.1)  # polling the cluster's layout with a deadline
        assert proc.wait(timeout=400) == 0, (tmp_path / "run.log").read_text()[-3000:]
        assert log.length() > before
    finally:
        if proc.poll() is None:
            proc.kill()
        client.close()
    events = _audit_clean(redis_cluster.url, run, tmp_path)
    assert any(isinstance(e.payload, ev.RunFinished) and e.payload.status == "completed" for e in events)
    assert redis_cluster.primary_of(keys.log_key(run)) == replica


def test_a_command_rides_out_an_uncoordinated_failover_and_lands_on_the_promoted_replica(
    redis_cluster: RedisClusterProcesses,
) -> None:
    """The run's primary is SIGKILLed: until its replica is promoted (the cluster's node timeout, 5 s here) the slot
    has no primary; an append made meanwhile waits (ConnectionError, then CLUSTERDOWN, ridden out within the outage
    deadline) and is written on the promoted replica. Only the waiting is checked: what the dead primary had
    acknowledged but not yet replicated may be lost (asynchronous replication; docs/deployment.md, Redis Cluster). The killed
    node is started again and rejoins as a replica, so the cluster is whole for whatever runs next."""
    from logbuilder import LogBuilder

    run = f"c-{uuid.uuid4().hex[:8]}"
    primary = redis_cluster.primary_of(keys.log_key(run))
    replica = redis_cluster.replica_of(primary)
    assert replica, f"the run's primary {primary} has no replica"
    client = connect(redis_cluster.url, retry_deadline=60.0)
    evs = LogBuilder().start_run().build()
    try:
        log = EventLog(client, run)
        log.append(evs[0])
        redis_cluster.kill(primary)
        t0 = time.monotonic()
        (stream_id,) = log.append_many(evs[1:2])
        waited = time.monotonic() - t0
        # the promoted node's own view: the others may still be learning of the failover by gossip
        assert redis_cluster.primary_of(keys.log_key(run), asking=replica) == replica
        assert stream_id in {s.stream_id for s in log.read()}
        assert waited > 1.0, waited  # it did have to wait for the promotion: the old primary was gone
    finally:
        client.close()
        if redis_cluster.procs[primary].poll() is not None:
            redis_cluster.start_node(primary)
            redis_cluster.wait_ok(time.monotonic() + 60)
    deadline = time.monotonic() + 60
    while redis_cluster.replica_of(replica) != primary:  # rejoined, as a replica of the promoted one
        assert time.monotonic() < deadline, "the killed primary did not rejoin as a replica within 60 s"
        time.sleep(0.1)  # polling the cluster's layout with a deadline
    redis_cluster.wait_ok(deadline)
