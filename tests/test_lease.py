"""events.lease: exactly one holder at a time, fencing tokens only grow, expiry lets the next contender in."""

from __future__ import annotations

import time

import pytest
import redis

from rolledger.events.keys import lease_key
from rolledger.events.lease import LeaderLease


def test_two_contenders_exactly_one_gets_the_token(redis_client: redis.Redis, run_id: str) -> None:
    a = LeaderLease(redis_client, run_id, "update", "coord-a", ttl_ms=60_000)
    b = LeaderLease(redis_client, run_id, "update", "coord-b", ttl_ms=60_000)
    results = [a.acquire(), b.acquire()]
    assert results == [1, None]
    assert (a.token, b.token) == (1, None)
    assert a.acquire() == 1  # re-acquiring while holding extends, same token
    assert a.renew() is True and b.renew() is False
    assert b.acquire() is None
    assert a.current_token() == 1


def test_expiry_lets_the_other_in_with_a_larger_token(redis_client: redis.Redis, run_id: str) -> None:
    a = LeaderLease(redis_client, run_id, "admission", "coord-a", ttl_ms=100)
    b = LeaderLease(redis_client, run_id, "admission", "coord-b", ttl_ms=60_000)
    first = a.acquire()
    assert first is not None
    deadline = time.monotonic() + 10.0
    second = b.acquire()
    while second is None:  # the real PX expiry: poll the condition with a deadline
        assert time.monotonic() < deadline, "lease did not expire within 10 s"
        time.sleep(0.02)
        second = b.acquire()
    assert second > first
    assert a.renew() is False and a.token is None  # the old leader learns it is fenced out
    a.release()  # releasing a lease that is no longer ours must not free b's
    assert redis_client.get(lease_key(run_id, "admission")) == f"coord-b#{second}".encode()
    assert a.acquire() is None


def test_release_frees_and_tokens_never_repeat(redis_client: redis.Redis, run_id: str) -> None:
    a = LeaderLease(redis_client, run_id, "trainer", "coord-a", ttl_ms=60_000)
    b = LeaderLease(redis_client, run_id, "trainer", "coord-b", ttl_ms=60_000)
    t1 = a.acquire()
    a.release()
    assert a.token is None
    t2 = b.acquire()
    b.release()
    t3 = a.acquire()
    assert t1 is not None and t2 is not None and t3 is not None
    assert t1 < t2 < t3


def test_restarted_holder_takes_over_with_a_new_token(redis_client: redis.Redis, run_id: str) -> None:
    old = LeaderLease(redis_client, run_id, "update", "coord-a", ttl_ms=60_000)
    t_old = old.acquire()
    fresh = LeaderLease(redis_client, run_id, "update", "coord-a", ttl_ms=60_000)  # same name, token lost in a crash
    t_new = fresh.acquire()
    assert t_old is not None and t_new is not None and t_new > t_old
    assert old.renew() is False  # the previous incarnation is fenced out


def test_holder_names_with_hash_are_not_confused(redis_client: redis.Redis, run_id: str) -> None:
    a = LeaderLease(redis_client, run_id, "r", "a#b", ttl_ms=60_000)
    b = LeaderLease(redis_client, run_id, "r", "a", ttl_ms=60_000)
    assert a.acquire() is not None
    assert b.acquire() is None


def test_bad_arguments_named(redis_client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="ttl_ms"):
        LeaderLease(redis_client, "r", "x", "h", ttl_ms=0)
    with pytest.raises(ValueError, match="holder"):
        LeaderLease(redis_client, "r", "x", "", ttl_ms=10)
