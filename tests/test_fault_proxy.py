"""tests/fault_proxy.py against the test redis-server: each fault does what it says (raw sockets speaking RESP, so
nothing retries behind the test's back), its bounds hold, and a real `rolledger run` whose Redis connection goes
through the proxy rides out a 2-second partition and audits clean."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
from audit_check import audited_log
from fault_proxy import MAX_DELAY_S, Direction, FaultProxy


def _port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


@pytest.fixture
def proxy(redis_url: str) -> Iterator[FaultProxy]:
    with FaultProxy(_port(redis_url)) as p:
        yield p


def _client(p: FaultProxy, timeout_s: float = 5.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", p.port), timeout=timeout_s)
    return s


def _ping(s: socket.socket) -> bytes:
    s.sendall(b"PING\r\n")
    return s.recv(64)


def _closed(s: socket.socket) -> bool:
    """Did the proxy end this connection (EOF or a reset)?"""
    try:
        s.sendall(b"PING\r\n")
        return s.recv(64) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def test_bytes_pass_both_ways_and_are_counted(proxy: FaultProxy) -> None:
    with _client(proxy) as s:
        assert _ping(s) == b"+PONG\r\n"
    stats = proxy.stats()
    assert stats.accepted == 1 and stats.forwarded[Direction.UP] == 6 and stats.forwarded[Direction.DOWN] == 7
    client = redis.Redis.from_url(proxy.url())
    assert client.set("fp:k", b"v") and client.get("fp:k") == b"v"
    client.close()


def test_latency_delays_every_answer(proxy: FaultProxy) -> None:
    proxy.set_latency(0.15, jitter_s=0.05)
    with _client(proxy) as s:
        started = time.monotonic()
        assert _ping(s) == b"+PONG\r\n"
        took = time.monotonic() - started
    assert took >= 0.3, took  # 0.15 s at least each way
    proxy.set_latency(0)
    with _client(proxy) as s:
        started = time.monotonic()
        assert _ping(s) == b"+PONG\r\n"
        assert time.monotonic() - started < 0.3


def test_reset_and_drop_end_open_connections(proxy: FaultProxy) -> None:
    a, b = _client(proxy), _client(proxy)
    assert _ping(a) == _ping(b) == b"+PONG\r\n"
    assert proxy.reset_all() == 2
    assert _closed(a) and _closed(b)
    c = _client(proxy)
    assert _ping(c) == b"+PONG\r\n"  # new connections are served
    assert proxy.drop_all() == 1 and _closed(c)
    stats = proxy.stats()
    assert stats.resets == 2 and stats.drops == 1
    for s in (a, b, c):
        s.close()


def test_a_stall_holds_the_answer_until_it_ends(proxy: FaultProxy) -> None:
    with _client(proxy, timeout_s=0.3) as s:
        assert _ping(s) == b"+PONG\r\n"
        proxy.stall(30)
        s.sendall(b"PING\r\n")
        with pytest.raises(TimeoutError):
            s.recv(64)
        proxy.resume()
        s.settimeout(5)
        assert s.recv(64) == b"+PONG\r\n"  # held, not lost


def test_a_cut_direction_drops_its_bytes_and_keeps_the_connection(proxy: FaultProxy, redis_url: str) -> None:
    direct = redis.Redis.from_url(redis_url)
    direct.delete("fp:cut")
    with _client(proxy, timeout_s=0.3) as s:
        proxy.cut(Direction.UP)
        s.sendall(b"SET fp:cut up\r\n")
        with pytest.raises(TimeoutError):
            s.recv(64)
        assert direct.get("fp:cut") is None  # never reached the server
        proxy.restore(Direction.UP)
        proxy.cut(Direction.DOWN)
        s.sendall(b"SET fp:cut down\r\n")
        deadline = time.monotonic() + 5
        while direct.get("fp:cut") != b"down":  # reached the server; its answer is dropped
            assert time.monotonic() < deadline, "the SET never reached the server"
            time.sleep(0.01)  # polling the server's state with a deadline
        with pytest.raises(TimeoutError):
            s.recv(64)
        proxy.restore()
        s.settimeout(5)
        assert _ping(s) == b"+PONG\r\n"  # the same connection, both ways again
    stats = proxy.stats()
    assert stats.dropped[Direction.UP] == len(b"SET fp:cut up\r\n") and stats.dropped[Direction.DOWN] == 5
    direct.close()


def test_a_partition_resets_open_and_new_connections_then_heals(proxy: FaultProxy) -> None:
    s = _client(proxy)
    assert _ping(s) == b"+PONG\r\n"
    started = time.monotonic()
    assert proxy.partition(3.0) == 1  # (long enough that a loaded machine still asks inside it)
    assert _closed(s)
    try:  # reset at accept: seen at the connect itself, or at the first command
        during = _client(proxy)
        assert _closed(during), proxy.stats()
        during.close()
    except ConnectionResetError:
        pass
    assert proxy.wait_healed(10) and time.monotonic() - started >= 3.0
    with _client(proxy) as after:
        assert _ping(after) == b"+PONG\r\n"
    stats = proxy.stats()
    assert stats.partitions == 1 and stats.refused >= 1 and stats.resets == 1
    s.close()


def test_bounds(redis_url: str) -> None:
    with pytest.raises(ValueError, match="not loopback"):
        FaultProxy(6379, "10.0.0.1")
    with FaultProxy(_port(redis_url), max_connections=1) as p:
        with pytest.raises(ValueError, match="latency"):
            p.set_latency(MAX_DELAY_S, jitter_s=1)
        with pytest.raises(ValueError, match="partition"):
            p.partition(3600)
        with pytest.raises(ValueError, match="stall"):
            p.stall(-1)
        first = _client(p)
        assert _ping(first) == b"+PONG\r\n"
        try:  # over max_connections: reset at once (at the connect, or at the first command)
            second = _client(p)
            assert _closed(second)
            second.close()
        except ConnectionResetError:
            pass
        assert p.stats().refused == 1
        first.close()


def test_a_run_through_the_proxy_rides_out_a_2_second_partition_and_audits_clean(
    redis_url: str, run_id: str, tmp_path: Path
) -> None:
    """Every Redis connection of a real run (torch engine, embedded defaults made small) goes through the proxy; once
    the trainer has finished a step, the network is partitioned for 2 s (every connection reset, new ones too). The
    run completes, and its log (read directly) audits clean."""
    from test_run_loop import small

    from rolledger.events.store import EventLog
    from rolledger.schemas import events as ev
    from rolledger.workers.operator.local_run import LocalRun, RunOptions

    direct = redis.Redis.from_url(redis_url)
    with FaultProxy(_port(redis_url)) as p:
        partitioned = threading.Event()

        def partition_after_first_step() -> None:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                events = [s.event.payload for s in EventLog(direct, run_id).read()]
                if any(isinstance(e, ev.TrainStepFinished) for e in events):
                    p.partition(2.0)
                    partitioned.set()
                    return
                time.sleep(0.2)  # polling the log for a condition, with a deadline

        watcher = threading.Thread(target=partition_after_first_step, name="partitioner", daemon=True)
        watcher.start()
        run = LocalRun(
            RunOptions(config=small(steps=4), redis_url=p.url(), run_id=run_id, runs_dir=tmp_path, deadline_s=240)
        )
        summary = run.execute()
        watcher.join(timeout=10)
        stats = p.stats()
    direct.close()
    assert partitioned.is_set(), "the run ended before its first trainer step was seen"
    assert summary.status == "completed", summary
    assert stats.partitions == 1 and stats.resets >= 1, stats  # live connections were cut
    events, report = audited_log(redis_url, run_id)
    assert report.ok and any(isinstance(e.payload, ev.RunFinished) for e in events)
