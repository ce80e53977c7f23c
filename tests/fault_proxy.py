"""A TCP fault proxy for the test kit: put it between a process and Redis (or any loopback TCP service) and make the
network between them bad on purpose.

`FaultProxy(upstream_port)` listens on a free 127.0.0.1 port and forwards every connection to 127.0.0.1:upstream_port
(loopback only, both ends), on an asyncio event loop in its own daemon thread. Faults, each callable from any thread:

- `set_latency(seconds, jitter_s)`: every chunk waits seconds + uniform(0, jitter_s) before it is forwarded (order
  kept; at most `MAX_DELAY_S` in all);
- `reset_all()`: every open connection is reset (RST: SO_LINGER 0); `drop_all()`: every one is closed (FIN);
- `stall(seconds)`: nothing is read from either side for that long (TCP back-pressure; the bytes wait in the kernel),
  then reads go on; `resume()` ends a stall early;
- `cut(direction)`: the bytes going one way (`Direction.UP`: client to server, `DOWN`: server to client) are dropped
  while the connection stays open; `restore(direction)` forwards again;
- `partition(seconds)`: every open connection is reset and new ones are reset at once, for that long: what a process
  sees of a network path that answers with resets (a blackholed path, where packets vanish, is `cut` both ways);
  `wait_healed(timeout_s)` waits for the end.

Bounded: at most `max_connections` connections at once (the next is reset), delays, stalls and partitions of at most
`MAX_DELAY_S`/`MAX_FAULT_S`; `stop()` closes everything and the thread ends. Counters (`stats()`) say what happened:
connections accepted and refused, resets, bytes forwarded and dropped per direction.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from types import TracebackType
from typing import Self

MAX_DELAY_S = 10.0
MAX_FAULT_S = 60.0
CHUNK = 65536


class Direction(StrEnum):
    UP = "up"  # client to server
    DOWN = "down"  # server to client


@dataclass
class ProxyStats:
    accepted: int = 0
    refused: int = 0  # reset at accept: partitioned, or over max_connections
    resets: int = 0  # open connections reset (reset_all, partition)
    drops: int = 0  # open connections closed (drop_all)
    partitions: int = 0
    forwarded: dict[Direction, int] = field(default_factory=lambda: dict.fromkeys(Direction, 0))
    dropped: dict[Direction, int] = field(default_factory=lambda: dict.fromkeys(Direction, 0))


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _bounded(seconds: float, limit: float, what: str) -> float:
    if not 0 <= seconds <= limit:
        raise ValueError(f"{what} must be within 0..{limit:g} s, not {seconds!r}")
    return float(seconds)


class _Conn:
    """One proxied connection: the client's writer and the server's."""

    def __init__(self, client: asyncio.StreamWriter, server: asyncio.StreamWriter) -> None:
        self.writers = {Direction.UP: server, Direction.DOWN: client}  # where the bytes of each direction go

    def close(self, reset: bool) -> None:
        for w in self.writers.values():
            if reset:
                sock = w.get_extra_info("socket")
                if sock is not None:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    except OSError:
                        pass
                w.transport.abort()
            else:
                w.close()


class FaultProxy:
    """See the module docstring."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1", *, max_connections: int = 256) -> None:
        if not _loopback(upstream_host):
            raise ValueError(f"upstream {upstream_host!r} is not loopback: the fault proxy stays on this machine")
        if not 0 < upstream_port < 65536:
            raise ValueError(f"upstream port {upstream_port!r} is not a port")
        self.upstream = (upstream_host, upstream_port)
        self.max_connections = max_connections
        self.port = 0
        self._lock = threading.Lock()
        self._stats = ProxyStats()
        self._latency = (0.0, 0.0)
        self._cut: set[Direction] = set()
        self._partitioned_until = 0.0
        self._healed = threading.Event()
        self._healed.set()
        self._conns: set[_Conn] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flowing: asyncio.Event | None = None
        self._stall_handle: asyncio.TimerHandle | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._rng = random.Random(0)

    # ------------------------------------------------------------ life
    def start(self, timeout_s: float = 10.0) -> Self:
        ready = threading.Event()
        failed: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._listen())
            except BaseException as exc:  # noqa: BLE001 - handed to start()
                failed.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=main, name="fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise RuntimeError("the fault proxy did not start")
        if failed:
            raise failed[0]
        return self

    async def _listen(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def stop(self) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for c in list(self._conns):
                c.close(reset=False)
            self._conns.clear()

        asyncio.run_coroutine_threadsafe(close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=10)
        self._loop = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def url(self, scheme: str = "redis", path: str = "/0") -> str:
        """The proxied address as a URL (redis://127.0.0.1:PORT/0)."""
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    def stats(self) -> ProxyStats:
        with self._lock:
            return ProxyStats(
                self._stats.accepted,
                self._stats.refused,
                self._stats.resets,
                self._stats.drops,
                self._stats.partitions,
                dict(self._stats.forwarded),
                dict(self._stats.dropped),
            )

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    # ------------------------------------------------------------ faults
    def set_latency(self, seconds: float, jitter_s: float = 0.0) -> None:
        _bounded(seconds + jitter_s, MAX_DELAY_S, "latency + jitter")
        with self._lock:
            self._latency = (_bounded(seconds, MAX_DELAY_S, "latency"), _bounded(jitter_s, MAX_DELAY_S, "jitter"))

    def reset_all(self) -> int:
        """Reset every open connection; how many."""
        return self._call(self._close_all, True)

    def drop_all(self) -> int:
        """Close every open connection (FIN); how many."""
        return self._call(self._close_all, False)

    def stall(self, seconds: float) -> None:
        seconds = _bounded(seconds, MAX_FAULT_S, "a stall")

        def begin() -> None:
            assert self._flowing is not None and self._loop is not None
            if self._stall_handle is not None:
                self._stall_handle.cancel()
            self._flowing.clear()
            self._stall_handle = self._loop.call_later(seconds, self._flowing.set)

        self._call(begin)

    def resume(self) -> None:
        def end() -> None:
            assert self._flowing is not None
            if self._stall_handle is not None:
                self._stall_handle.cancel()
                self._stall_handle = None
            self._flowing.set()

        self._call(end)

    def cut(self, direction: Direction) -> None:
        with self._lock:
            self._cut.add(Direction(direction))

    def restore(self, direction: Direction | None = None) -> None:
        with self._lock:
            if direction is None:
                self._cut.clear()
            else:
                self._cut.discard(Direction(direction))

    def partition(self, seconds: float) -> int:
        """Reset every open connection and every new one for `seconds`; how many open ones were reset."""
        seconds = _bounded(seconds, MAX_FAULT_S, "a partition")
        with self._lock:
            self._partitioned_until = time.monotonic() + seconds
            self._stats.partitions += 1
            self._healed.clear()
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._loop.call_later, seconds, self._heal_if_due)
        return self._call(self._close_all, True)

    def heal(self) -> None:
        """End a partition now."""
        with self._lock:
            self._partitioned_until = 0.0
            self._healed.set()

    def wait_healed(self, timeout_s: float) -> bool:
        return self._healed.wait(timeout_s)

    @property
    def partitioned(self) -> bool:
        with self._lock:
            return time.monotonic() < self._partitioned_until

    # ------------------------------------------------------------ inside the loop
    def _call(self, fn: object, *args: object) -> int:
        assert self._loop is not None, "the fault proxy is not started"

        async def run() -> int:
            result = fn(*args)  # type: ignore[operator]
            return int(result or 0)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=10)

    def _heal_if_due(self) -> None:
        with self._lock:
            if time.monotonic() >= self._partitioned_until:
                self._partitioned_until = 0.0
                self._healed.set()
            else:  # partitioned again since: heal at the later end
                assert self._loop is not None
                self._loop.call_later(self._partitioned_until - time.monotonic(), self._heal_if_due)

    def _close_all(self, reset: bool) -> int:
        conns = list(self._conns)
        for c in conns:
            c.close(reset)
        self._conns.clear()
        with self._lock:
            if reset:
                self._stats.resets += len(conns)
            else:
                self._stats.drops += len(conns)
        return len(conns)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.partitioned or len(self._conns) >= self.max_connections:
            with self._lock:
                self._stats.refused += 1
            _Conn(writer, writer).close(reset=True)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            with self._lock:
                self._stats.refused += 1
            _Conn(writer, writer).close(reset=True)
            return
        conn = _Conn(writer, up_writer)
        self._conns.add(conn)
        with self._lock:
            self._stats.accepted += 1
        await asyncio.gather(
            self._pump(conn, reader, Direction.UP), self._pump(conn, up_reader, Direction.DOWN), return_exceptions=True
        )
        self._conns.discard(conn)
        conn.close(reset=False)

    async def _pump(self, conn: _Conn, reader: asyncio.StreamReader, direction: Direction) -> None:
        assert self._flowing is not None
        out = conn.writers[direction]
        try:
            while True:
                await self._flowing.wait()
                data = await reader.read(CHUNK)
                if not data:
                    break
                await self._flowing.wait()  # a chunk read just before a stall waits it out too
                with self._lock:
                    latency, jitter = self._latency
                    cut = direction in self._cut
                delay = latency + (self._rng.uniform(0, jitter) if jitter else 0.0)
                if delay:
                    await asyncio.sleep(delay)  # the fault itself: this chunk is late
                if cut:
                    with self._lock:
                        self._stats.dropped[direction] += len(data)
                    continue
                with self._lock:  # counted before it is handed on: whoever received it reads it counted
                    self._stats.forwarded[direction] += len(data)
                out.write(data)
                await out.drain()
        except (ConnectionError, OSError):
            pass
        finally:  # one side ended: end the other (a half-open proxy would hide the fault it models)
            for w in conn.writers.values():
                if not w.is_closing():
                    w.close()
