"""A real Redis Sentinel setup on loopback for the tests: one primary, one replica (both redis-server with AOF on) and
three sentinels (`redis-server --sentinel`, quorum 2), each in its own directory on a free port. Every wait has a
deadline and names what it was waiting for."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from typing import Any, cast

import redis

from rolledger.events.embedded import find_redis_server

MASTER_NAME = "rolledger"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(what: str, check: object, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if check():  # type: ignore[operator]
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)  # polling a condition with a deadline, not a synchronising sleep
    raise TimeoutError(f"sentinel kit: gave up after {deadline_s:.0f}s waiting for {what}")


class SentinelProcesses:
    """Primary + replica + 3 sentinels, started with `start()`, stopped with `stop()`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.primary_port = _free_port()
        self.replica_port = _free_port()
        self.sentinel_ports = [_free_port() for _ in range(3)]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """The sentinel URL the project takes (events/connection.py)."""
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{MASTER_NAME}"

    def _spawn(self, port: int, args: list[str]) -> None:
        d = self.workdir / str(port)
        d.mkdir(parents=True, exist_ok=True)
        log = open(d / "log", "wb")  # noqa: SIM115 - lives as long as the process
        self.procs[port] = subprocess.Popen([str(find_redis_server()), *args], cwd=d, stdout=log, stderr=log)

    def start(self) -> SentinelProcesses:
        data = ["--bind", "127.0.0.1", "--appendonly", "yes", "--save", ""]
        self._spawn(self.primary_port, ["--port", str(self.primary_port), *data])
        self._spawn(
            self.replica_port,
            ["--port", str(self.replica_port), *data, "--replicaof", "127.0.0.1", str(self.primary_port)],
        )
        _wait(
            "the replica's link to the primary",
            lambda: self.node(self.replica_port).info("replication")["master_link_status"] == "up",
        )
        for port in self.sentinel_ports:
            conf = self.workdir / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.primary_port} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} 1000\n"
                f"sentinel failover-timeout {MASTER_NAME} 10000\n"
            )
            self._spawn(port, [str(conf), "--sentinel"])
        _wait(
            "every sentinel to see the replica and the other sentinels",
            lambda: all(self._sees_all(p) for p in self.sentinel_ports),
        )
        return self

    def _sees_all(self, port: int) -> bool:
        master = cast(dict[str, Any], self.node(port).sentinel_master(MASTER_NAME))
        return int(master["num-other-sentinels"]) == 2 and int(master["num-slaves"]) == 1

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)

    def primary(self) -> int:
        """The port the sentinels name as the primary now."""
        addr = cast(tuple[str, int], self.node(self.sentinel_ports[0]).sentinel_get_master_addr_by_name(MASTER_NAME))
        return int(addr[1])

    def role(self, port: int) -> str:
        return str(self.node(port).info("replication")["role"])

    def failover(self, deadline_s: float = 30.0, *, until_demoted: bool = True) -> int:
        """SENTINEL FAILOVER: returns the new primary's port once it answers as master and (until_demoted) once the
        old primary answers as a replica. Between the two the old primary still takes writes, and loses them when
        it resyncs from the new one: a coordinated switch keeps writers off until the old primary is demoted."""
        old = self.primary()
        self.node(self.sentinel_ports[0]).execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
        _wait("the sentinels to name a new primary", lambda: self.primary() != old, deadline_s)
        new = self.primary()
        _wait(f"127.0.0.1:{new} to answer as master", lambda: self.role(new) == "master", deadline_s)
        if until_demoted:
            _wait(f"old primary 127.0.0.1:{old} to answer as a replica", lambda: self.role(old) == "slave", deadline_s)
        return new

    def failover_settled(self, old: int, deadline_s: float = 30.0) -> None:
        """Wait until the old primary is a replica with its link up (it has resynced from the new primary)."""
        _wait(
            f"old primary 127.0.0.1:{old} to resync as a replica",
            lambda: self.node(old).info("replication").get("master_link_status") == "up",
            deadline_s,
        )

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
        for proc in self.procs.values():
            proc.wait(timeout=10)
