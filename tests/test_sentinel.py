"""redis+sentinel:// URLs (events/connection.py) against a real primary, replica and three sentinels
(tests/redis_sentinel.py): parsing, and appends that go on across a coordinated SENTINEL FAILOVER."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from redis_sentinel import MASTER_NAME, SentinelProcesses

from rolledger.events.connection import connect, parse_redis_url, sentinel_target


def test_sentinel_url_parses() -> None:
    scheme, options, nodes = parse_redis_url("redis+sentinel://:pw@127.0.0.1:26379,[::1]:26380/mymaster/2")
    assert scheme == "redis+sentinel"
    assert nodes == [("127.0.0.1", 26379), ("::1", 26380)]
    assert options["service_name"] == "mymaster" and options["db"] == 2 and options["password"] == "pw"


@pytest.mark.parametrize(
    "url", ["redis+sentinel://127.0.0.1:26379", "redis+sentinel://127.0.0.1:26379/m/x", "redis+sentinel://h/m"]
)
def test_bad_sentinel_url_is_one_line_without_the_password(url: str) -> None:
    with pytest.raises(ValueError, match="redis\\+sentinel://|is not host:port") as info:
        sentinel_target(url.replace("://", "://:secret@"))
    assert "secret" not in str(info.value)


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelProcesses]:
    kit = SentinelProcesses(tmp_path).start()
    try:
        yield kit
    finally:
        kit.stop()
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_appends_go_on_across_a_coordinated_failover(sentinels: SentinelProcesses) -> None:
    client = connect(sentinels.url, retry_deadline=30)
    for i in range(50):
        client.xadd("s", {"i": i})
    old = sentinels.primary()
    assert client.execute_command("WAIT", 1, 5000) == 1  # replicated before the switch
    new = sentinels.failover()
    assert new != old
    for i in range(50, 100):
        client.xadd("s", {"i": i})  # the same client: the demoted primary's READONLY sends it to the new one
    assert sentinels.node(new).xlen("s") == 100
    assert [int(f[b"i"]) for _, f in cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange("s"))] == list(
        range(100)
    )
    assert MASTER_NAME in sentinels.url


def test_a_write_acknowledged_by_a_primary_being_replaced_is_lost_and_wait_says_so(
    sentinels: SentinelProcesses,
) -> None:
    """What an uncoordinated switch loses: a write the old primary acknowledged after its replica stopped following
    it. WAIT 1 answers 0 for that write (no replica has it), which is what a min_replicas append would refuse."""
    old = sentinels.primary()
    direct = sentinels.node(old)
    direct.xadd("s", {"i": 0})
    assert direct.execute_command("WAIT", 1, 5000) == 1
    new = sentinels.failover(until_demoted=False)
    if sentinels.role(old) == "slave":
        pytest.skip("the sentinels demoted the old primary before the test could write to it")
    direct.xadd("s", {"i": 1})  # acknowledged by the old primary, which no replica follows now
    assert direct.execute_command("WAIT", 1, 200) == 0
    sentinels.failover_settled(old)
    assert [int(f[b"i"]) for _, f in cast(list[tuple[bytes, dict[bytes, bytes]]], sentinels.node(new).xrange("s"))] == [
        0
    ]  # the acknowledged write is gone
