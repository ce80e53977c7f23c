"""A real Redis Cluster on loopback for the tests: N primaries (and one replica each, when asked), each a redis-server
process with `--cluster-enabled yes` and AOF on, in its own directory on free ports, joined by `redis-cli --cluster
create`. Every wait has a deadline and names what it was waiting for."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from rolledger.events.embedded import find_redis_server


def redis_binary() -> str:
    """The redis-server the tests use (the same rule as conftest's and the embedded server's)."""
    return str(find_redis_server())


def _free_ports(n: int) -> list[int]:
    """n free loopback ports whose cluster bus ports (port + 10000) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports


def redis_cli() -> str | None:
    """The redis-cli next to the redis-server the tests use, else the one on PATH; None when there is none."""
    beside = Path(redis_binary()).with_name("redis-cli")
    return str(beside) if beside.exists() else shutil.which("redis-cli")


class RedisClusterProcesses:
    """`primaries` primaries and `replicas` replicas per primary on loopback, started with `start()`."""

    def __init__(self, workdir: Path, *, primaries: int = 3, replicas: int = 0) -> None:
        self.workdir = workdir
        self.replicas = replicas
        self.ports = _free_ports(primaries * (1 + replicas))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """The cluster URL the project takes (events/connection.py), naming every node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def node(self, port: int) -> redis.Redis:
        """A plain client of one node (CLUSTER commands, INFO, CONFIG)."""
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)

    def start(self, deadline_s: float = 60.0) -> None:
        cli = redis_cli()
        assert cli is not None, "redis-cli is needed to create a cluster"
        for port in self.ports:
            self.start_node(port)
        deadline = time.monotonic() + deadline_s
        for port in self.ports:
            self._wait(lambda p=port: self._pings(p), deadline, f"node 127.0.0.1:{port} to answer PING")
        create = subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports)]
            + ["--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=False,
            capture_output=True,
            text=True,
            timeout=max(1.0, deadline - time.monotonic()),
        )
        assert create.returncode == 0, create.stdout[-2000:] + create.stderr[-2000:]
        self.wait_ok(deadline)

    def start_node(self, port: int) -> None:
        """Start (or start again, over its AOF and nodes.conf: it rejoins the cluster) the node on `port`."""
        d = self.workdir / str(port)
        d.mkdir(parents=True, exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [
                redis_binary(),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(d),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(d / "nodes.conf"),
                "--cluster-node-timeout",
                "5000",
                "--appendonly",
                "yes",
                "--appendfsync",
                "no",
                "--save",
                "",
                "--logfile",
                str(d / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def kill(self, port: int) -> None:
        """SIGKILL the node on `port` (an uncoordinated failure: its replica is promoted after the node timeout)."""
        self.procs[port].kill()
        self.procs[port].wait(timeout=20)

    def wait_ok(self, deadline: float) -> None:
        """Until every node says cluster_state:ok and agrees on the layout of the 16384 slots, and every replica has
        finished its first sync."""
        self._wait(self._settled, deadline, "cluster_state:ok on every node, replicas in sync")

    def _settled(self) -> bool:
        for port in self.ports:
            if self.procs[port].poll() is not None:
                continue  # a node a test stopped
            node = self.node(port)
            try:
                info = node.cluster("info")
                if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != 16384:
                    return False
                repl = node.info("replication")
                if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                    return False
            except (redis.ConnectionError, redis.BusyLoadingError):  # a node starting again, replaying its AOF
                return False
            finally:
                node.close()
        return True

    def _pings(self, port: int) -> bool:
        node = self.node(port)
        try:
            return bool(node.ping())
        except redis.ConnectionError:
            if self.procs[port].poll() is not None:
                raise RuntimeError(f"redis-server on {port} exited; see {self.workdir / str(port) / 'redis.log'}")
            return False
        finally:
            node.close()

    @staticmethod
    def _wait(ready: object, deadline: float, what: str) -> None:
        assert callable(ready)
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.05)  # polling a readiness condition with a deadline, not synchronising a test

    def primary_of(self, key: str, asking: int | None = None) -> int:
        """The port of the primary serving `key`'s slot, as the cluster itself says (CLUSTER KEYSLOT, CLUSTER SLOTS),
        in the view of the node on `asking` (default: the first live node). Just after a failover only the promoted
        node is sure to know it; the others learn it by gossip."""
        if asking is None:
            asking = next(p for p in self.ports if self.procs[p].poll() is None)
        node = self.node(asking)
        try:
            slot = int(node.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, primary, *_replicas in node.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(primary[1])
        finally:
            node.close()
        raise AssertionError(f"slot of {key!r} is served by no primary")

    def replica_of(self, primary: int) -> int:
        """The port of a replica of the primary on `primary` (ROLE on the primary); 0 when it has none."""
        node = self.node(primary)
        try:
            role = node.execute_command("ROLE")
        finally:
            node.close()
        assert role[0] == b"master", f"127.0.0.1:{primary} is not a primary: {role}"
        if not role[2]:
            return 0  # no replica (yet)
        return int(role[2][0][1])

    def stop(self, deadline_s: float = 5.0) -> None:
        """SIGTERM every node, SIGKILL what is left after deadline_s: a replica that has just synced refuses a
        SIGTERM while it writes its first AOF ("Writing initial AOF, can't exit"), and this data is throwaway."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + deadline_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=20)
