"""A real Redis Sentinel setup on loopback for the tests: one primary, one replica (both redis-server with AOF on) and
three sentinels (`redis-server --sentinel`, quorum 2), each in its own directory on a free port. Every wait has a
deadline and names what it was waiting for.

Two ways to switch primaries mid-run:

- `coordinated_failover()`: what an operator does for maintenance. Writes are paused on the primary (CLIENT PAUSE
  WRITE), the replica is waited for until it has every byte of the replication stream, then SENTINEL FAILOVER
  promotes it; the sentinels' reconfiguration of the old primary disconnects its clients, whose paused commands were
  never run there, so they are retried on the new primary. Nothing acknowledged is lost. (SENTINEL FAILOVER alone,
  `failover()`, is not coordinated in Redis 7: it promotes the replica while the old primary still takes writes,
  and those are lost when it resyncs.)
- `lag_replica()` then `kill_primary()`: an uncoordinated switch. Started with `replication_proxy=True`, the replica
  follows the primary through a tests/fault_proxy.py; `lag_replica()` drops what the primary sends it (the link
  stays up, so the sentinels still count the replica fit to promote), the primary goes on acknowledging writes no
  replica has, and `kill_primary()` SIGKILLs it: the sentinels promote the replica, and those writes are gone.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from typing import Any, cast

import redis
from fault_proxy import Direction, FaultProxy

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
        self.proxy: FaultProxy | None = None  # between the replica and the primary (start(replication_proxy=True))

    @property
    def url(self) -> str:
        """The sentinel URL the project takes (events/connection.py)."""
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{MASTER_NAME}"

    def _spawn(self, port: int, args: list[str]) -> None:
        d = self.workdir / str(port)
        d.mkdir(parents=True, exist_ok=True)
        log = open(d / "log", "wb")  # noqa: SIM115 - lives as long as the process
        self.procs[port] = subprocess.Popen([str(find_redis_server()), *args], cwd=d, stdout=log, stderr=log)

    def start(self, *, replication_proxy: bool = False) -> SentinelProcesses:
        data = ["--bind", "127.0.0.1", "--appendonly", "yes", "--save", ""]
        self._spawn(self.primary_port, ["--port", str(self.primary_port), *data])
        follows = self.primary_port
        if replication_proxy:
            self.proxy = FaultProxy(self.primary_port).start()
            follows = self.proxy.port
        self._spawn(
            self.replica_port,
            ["--port", str(self.replica_port), *data, "--replicaof", "127.0.0.1", str(follows)],
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

    def coordinated_failover(self, deadline_s: float = 30.0) -> int:
        """A switch that loses nothing acknowledged (see the module docstring); returns the new primary's port.

        1. CLIENT PAUSE WRITE on the primary: writes (the appends' scripts, XREADGROUP) wait there, unrun;
        2. the replica is waited for until its offset reaches the paused primary's;
        3. SENTINEL FAILOVER, and the sentinels are waited for until they name the replica, which answers as master;
        4. the old primary is made a replica of it (REPLICAOF: what the sentinels would do some seconds later) and
           its clients are disconnected (CLIENT KILL TYPE normal), then unpaused: whatever was paused there is
           retried on the new primary, or refused as READONLY and then retried there.

        The pause is lifted in step 4, not at its end: a sentinel's hello (a PUBLISH) is paused as well and holds up
        the sentinel's next commands to that node, so waiting for the sentinels to demote it would wait out the
        pause."""
        old = self.primary()
        node = self.node(old)
        node.execute_command("CLIENT", "PAUSE", int(deadline_s * 1000), "WRITE")
        try:
            offset = int(node.info("replication")["master_repl_offset"])
            replica = self.replica_of(old)
            _wait(
                "the replica to hold the paused primary's whole replication stream",
                lambda: int(self.node(replica).info("replication")["slave_repl_offset"]) >= offset,
                deadline_s,
            )
            new = self.failover(deadline_s, until_demoted=False)
            node.execute_command("REPLICAOF", "127.0.0.1", new)
            node.execute_command("CLIENT", "KILL", "TYPE", "normal")
        finally:
            node.execute_command("CLIENT", "UNPAUSE")
        _wait(f"old primary 127.0.0.1:{old} to answer as a replica", lambda: self.role(old) == "slave", deadline_s)
        return new

    def replica_of(self, primary: int) -> int:
        """The port of the (one) replica of `primary`."""
        return self.replica_port if primary == self.primary_port else self.primary_port

    def lag_replica(self) -> None:
        """Drop what the primary sends the replica from now on (needs start(replication_proxy=True))."""
        assert self.proxy is not None, "start(replication_proxy=True) puts the proxy the lag needs in place"
        self.proxy.cut(Direction.DOWN)

    def kill_primary(self) -> int:
        """SIGKILL the primary; returns its port."""
        old = self.primary()
        proc = self.procs[old]
        proc.kill()
        proc.wait(timeout=10)
        return old

    def wait_promoted(self, old: int, deadline_s: float = 30.0) -> int:
        """Wait until the sentinels name another primary than `old` and it answers as master; its port."""
        _wait("the sentinels to promote the replica", lambda: self.primary() != old, deadline_s)
        new = self.primary()
        _wait(f"127.0.0.1:{new} to answer as master", lambda: self.role(new) == "master", deadline_s)
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
        if self.proxy is not None:
            self.proxy.stop()
