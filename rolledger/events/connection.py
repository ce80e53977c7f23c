"""Redis connections for every rolledger process: one function from a URL (and credentials, TLS files) to a client.

URLs: `redis://[user:password@]host:port/db`, `rediss://...` (TLS), `unix:///path/to/redis.sock[?db=N]`, and for a
Redis Cluster `redis+cluster://[user:password@]host:port[,host:port...]` (`rediss+cluster://` with TLS): the nodes
named are where the client first learns the cluster's layout (one reachable node is enough; name several so a dead
one does not stop a start), and the client then routes each command to the primary serving its key's hash slot.
Every key of a run carries the `{run-id}` hash tag (events/keys.py), so a run's keys, Lua scripts and MULTI blocks
stay on one slot of one primary, and several runs spread over the shards. A cluster client is redis-py's
`RedisCluster` (as `ClusterClient`), handed out under the `redis.Redis` type: it answers every command the project
sends (streams, strings, hashes, scripts routed by their KEYS); a keyless command meant for a run's server (INFO,
WAITAOF) goes through `at_key`. A cluster has no databases: a path other than `/` or `/0` is refused.
Credentials, first found wins: the `username`/`password` arguments, then the URL's user info, then the
`REDIS_USERNAME`/`REDIS_PASSWORD` environment variables. Clients return bytes (`decode_responses=False`: the event
codec needs the raw bytes), check idle connections with a PING every `health_check_interval` seconds, and fail a
connect after `connect_timeout_s` rather than hanging. Reads have no socket timeout, so XREAD/XREADGROUP BLOCK
(bounded by their own block_ms) are not cut short.

Outages are ridden out (events/outage.py: `OutageRetry`, `RedisUnavailable`, `waiting_notice`), refusals fail at
once and are said in one line (events/refusal.py), and a cluster client is events/cluster.py's `ClusterClient`.
"""

from __future__ import annotations

import os
import socket
import ssl
from typing import Any, cast

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import Connection, ConnectionPool, SSLConnection, UnixDomainSocketConnection, parse_url
from redis.exceptions import RedisClusterException
from redis.sentinel import Sentinel, SentinelManagedConnection

from rolledger.events.cluster import ClusterClient
from rolledger.events.outage import (
    CLUSTER_RETRY_ON,
    RETRY_ON,
    OutageRetry,
    TlsHandshakeFailed,
    no_op,
    retry_deadline_s,
    transient,
)
from rolledger.events.redact import redact

HEALTH_CHECK_INTERVAL_S = 30
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
# Redis Sentinel: redis+sentinel://[user:password@]host:port[,host:port...]/MASTER_NAME[/db]. The hosts are sentinels;
# the credentials are the data servers' (the sentinels are asked without them). The client (redis-py's
# SentinelConnectionPool) asks the sentinels for the current primary on every (re)connect, and a connection to a
# primary that was demoted (READONLY) is dropped as a ConnectionError, so the outage retry lands on the new primary.
SENTINEL_SCHEME = "redis+sentinel"


class _TlsConnection(SSLConnection):
    """redis-py's SSLConnection that tells the TCP connect (an outage when it fails: ridden out) from the TLS
    handshake over it (`TlsHandshakeFailed` when it fails: refused at once, not waited out for the deadline)."""

    def _connect(self) -> socket.socket:
        sock = Connection._connect(self)
        try:
            return cast(socket.socket, self._wrap_socket_with_ssl(sock))
        except (ssl.SSLError, TimeoutError) as exc:
            sock.close()
            why = "no TLS answer within the connect timeout" if not isinstance(exc, ssl.SSLError) else str(exc)
            raise TlsHandshakeFailed(f"TLS handshake with {self.host}:{self.port} failed: {why}") from exc
        except (OSError, redis.RedisError):
            sock.close()
            raise


class _SentinelConnection(SentinelManagedConnection):
    """redis-py's connection to the primary the sentinels name, asking them again on every reconnect attempt.

    redis-py 8 reconnects a dropped connection inside `send_packed_command` through `connect_check_health`, which its
    SentinelManagedConnection does not override, and retries the socket connect there to the same address: a client
    whose connection a demoted primary closed (a coordinated failover disconnects its clients) reconnected to it and
    read READONLY at every retry, and one whose primary died tried the dead address until the outage deadline. Here
    each attempt of a primary connection's reconnect asks the sentinels first (`connect_to`, the path that asked them
    already, does not ask twice). redis-py 5-7 reconnect through `connect`, which asks them as it should."""

    _addressed = False

    def connect_to(self, address: tuple[str, int]) -> None:
        self._addressed = True
        try:
            super().connect_to(address)
        finally:
            self._addressed = False

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self._sock or self._addressed or not self.connection_pool.is_master:
            super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)
            return

        def attempt() -> None:
            self.connect_to(self.connection_pool.get_master_address())

        if retry_socket_connect:
            self.retry.call_with_retry(attempt, lambda error: self.disconnect())
        else:
            attempt()


def is_cluster_url(url: str) -> bool:
    """Does this URL name a Redis Cluster (`redis+cluster://`, `rediss+cluster://`)?"""
    return url.split("://", 1)[0] in CLUSTER_SCHEMES if "://" in url else False


def at_key(client: redis.Redis, key: str, *args: Any) -> Any:
    """A keyless command (INFO, WAITAOF) on the server that holds `key`: the client's server, or on a Redis Cluster
    the primary serving `key`'s hash slot (where a plain command without keys would land on any node)."""
    if isinstance(client, ClusterClient):
        return client.at_key(key, *args)
    if isinstance(client, RedisCluster):
        return client.execute_command(*args, target_nodes=client.get_node_from_key(key))
    return client.execute_command(*args)


def node_client(client: redis.Redis, key: str) -> redis.Redis:
    """A client whose pipeline runs on one connection to the server holding `key`: the client itself, or on a Redis
    Cluster the plain client of the primary serving `key`'s slot (no outage retry of its own: one attempt)."""
    if isinstance(client, RedisCluster):
        return client.get_redis_connection(client.get_node_from_key(key))
    return client


def cluster_nodes(url: str) -> list[tuple[str, int]]:
    """The (host, port) startup nodes a `redis+cluster://` URL names. Raises ValueError naming what is wrong."""
    _scheme, _, rest = url.partition("://")
    netloc, _, tail = rest.partition("/")
    if tail not in ("", "0") or "?" in rest or "#" in rest:
        raise ValueError(
            f"redis url {redact(url)!r}: a cluster URL is redis+cluster://[user:password@]host:port[,host:port...] "
            "(no database, no query: a cluster has only database 0)"
        )
    hosts = netloc.rpartition("@")[2]
    nodes = []
    for item in hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        host = host.strip("[]")  # [::1]:7000
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"redis url {redact(url)!r}: cluster node {item!r} is not host:port")
        nodes.append((host, int(port)))
    return nodes


def sentinel_target(url: str) -> tuple[list[tuple[str, int]], str, int]:
    """(sentinel (host, port) list, master name, db) of a `redis+sentinel://` URL. Raises ValueError naming what is
    wrong (the password redacted)."""
    _scheme, _, rest = url.partition("://")
    netloc, _, path = rest.partition("/")
    parts = path.split("/") if path else []
    if (
        "?" in rest
        or "#" in rest
        or not parts
        or not parts[0]
        or len(parts) > 2
        or (len(parts) == 2 and not parts[1].isdigit())
    ):
        raise ValueError(
            f"redis url {redact(url)!r}: a sentinel URL is "
            "redis+sentinel://[user:password@]host:port[,host:port...]/MASTER_NAME[/db]"
        )
    nodes = cluster_nodes(f"redis+cluster://{netloc}")
    return nodes, parts[0], int(parts[1]) if len(parts) == 2 else 0


def parse_redis_url(url: str) -> tuple[str, dict[str, Any], list[tuple[str, int]]]:
    """(scheme, redis-py connection options, cluster startup nodes) of a URL, without connecting; ValueError naming
    what is wrong (the password redacted). `rolledger run` checks its --redis with it before anything starts."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix", SENTINEL_SCHEME, *CLUSTER_SCHEMES):
        raise ValueError(
            f"redis url {redact(url)!r}: scheme must be redis://, rediss://, unix://, redis+cluster:// or "
            "rediss+cluster://, or redis+sentinel://"
        )
    nodes: list[tuple[str, int]] = []
    if scheme in (*CLUSTER_SCHEMES, SENTINEL_SCHEME):
        if scheme == SENTINEL_SCHEME:
            nodes, master, db = sentinel_target(url)
        else:
            nodes = cluster_nodes(url)
        userinfo = url.partition("://")[2].partition("/")[0].rpartition("@")[0]
        parsed = parse_url("redis://" + (userinfo + "@" if userinfo else "") + "localhost")
        options: dict[str, Any] = {k: v for k, v in parsed.items() if k in ("username", "password")}
        if scheme == SENTINEL_SCHEME:
            options["service_name"] = master
            options["db"] = db
    else:
        try:
            options = parse_url(url)
        except ValueError as exc:
            raise ValueError(f"redis url {redact(url)!r}: {exc}") from None
    if scheme == "unix" and not options.get("path"):
        raise ValueError(f"redis url {redact(url)!r}: unix:// needs a socket path, e.g. unix:///run/redis.sock")
    return scheme, options, nodes


def connect(
    url: str,
    *,
    password: str | None = None,
    username: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_insecure: bool = False,
    connect_timeout_s: float = 5.0,
    retry_deadline: float | None = None,
) -> redis.Redis:
    """A client for `url`: a redis.Redis for redis://, rediss://, unix://; a `ClusterClient` for redis+cluster:// and
    rediss+cluster:// (see the module docstring). Raises ValueError naming what is wrong with the input.

    tls_ca: CA bundle to verify the server with (default: the system store); tls_cert/tls_key: client certificate
    and key for servers with `tls-auth-clients yes`; tls_insecure: skip certificate and host name verification
    (tests, self-signed lab setups only). TLS options with a URL that is not rediss:// or rediss+cluster:// are an error.
    retry_deadline: how long an outage is ridden out (seconds; default: see `retry_deadline_s`).
    """
    scheme, options, nodes = parse_redis_url(url)
    tls = scheme in ("rediss", "rediss+cluster")
    cluster = scheme in CLUSTER_SCHEMES
    if scheme in ("redis", "rediss") and not options.get("host"):
        options["host"] = "localhost"

    tls_given = [n for n, v in (("tls_ca", tls_ca), ("tls_cert", tls_cert), ("tls_key", tls_key)) if v]
    if tls_insecure:
        tls_given.append("tls_insecure")
    if not tls and tls_given:
        raise ValueError(f"{', '.join(tls_given)} given but redis url {redact(url)!r} is not rediss:// (TLS)")
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert and tls_key must be given together (client certificate and its key)")

    user = username or options.pop("username", None) or os.environ.get("REDIS_USERNAME") or None
    secret = password or options.pop("password", None) or os.environ.get("REDIS_PASSWORD") or None
    if user and not secret:
        raise ValueError(f"redis username {user!r} given without a password (arguments, URL or REDIS_PASSWORD)")
    options["username"] = user
    options["password"] = secret

    if tls:
        if cluster:
            options["ssl"] = True
        else:
            options["connection_class"] = _TlsConnection
        options["ssl_ca_certs"] = tls_ca
        options["ssl_certfile"] = tls_cert
        options["ssl_keyfile"] = tls_key
        options["ssl_cert_reqs"] = "none" if tls_insecure else "required"
        options["ssl_check_hostname"] = not tls_insecure
    elif scheme == "unix":
        options["connection_class"] = UnixDomainSocketConnection

    options["decode_responses"] = False
    options["health_check_interval"] = HEALTH_CHECK_INTERVAL_S
    options["socket_connect_timeout"] = connect_timeout_s
    if scheme != "unix":
        options["socket_keepalive"] = True
    if cluster:
        outage = OutageRetry(retry_deadline_s(retry_deadline), errors=CLUSTER_RETRY_ON, url=url)
        startup = [ClusterNode(host, port) for host, port in nodes]

        def start() -> ClusterClient:
            try:  # the client reads the layout now: an unreachable cluster is ridden out like any outage
                return ClusterClient(outage_retry=outage, startup_nodes=startup, **options)
            except RedisClusterException as exc:  # every startup node failed; `from` holds the last node's error
                if "Cluster mode is not enabled" in str(exc):
                    raise ValueError(
                        f"redis url {redact(url)!r}: the server is not a cluster node (cluster-enabled is off); "
                        "use redis:// for a single server"
                    ) from None
                cause = exc.__cause__
                if cause is not None and not transient(cause):
                    raise cause from None
                raise redis.ConnectionError(str(exc)) from exc

        client = outage.call_with_retry(start, no_op)
        return cast(redis.Redis, client)  # see the module docstring: the commands the project sends, routed by key
    options["retry"] = OutageRetry(retry_deadline_s(retry_deadline), url=url)
    options["retry_on_error"] = list(RETRY_ON)
    if scheme == SENTINEL_SCHEME:
        service = options.pop("service_name")
        sentinels = Sentinel(
            nodes,
            sentinel_kwargs={"socket_connect_timeout": connect_timeout_s, "socket_timeout": connect_timeout_s},
        )
        options.setdefault("connection_class", _SentinelConnection)
        return cast(redis.Redis, sentinels.master_for(service, redis_class=redis.Redis, **options))
    return redis.Redis(connection_pool=ConnectionPool(**options))
