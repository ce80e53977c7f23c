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

Outages: every command (and every connect) is retried through `OutageRetry`, redis-py's `Retry` with
`ExponentialBackoff` on ConnectionError / TimeoutError / BusyLoadingError (a server restarting over its AOF answers
LOADING), for up to `retry_deadline_s` (argument, else `ROLLEDGER_REDIS_DEADLINE_S`, default 60 s) from the first
failure. An outage logs one warning ("redis unavailable, retrying") and one line when Redis is back, whatever the
number of threads and connections. When the deadline runs out the command raises `RedisUnavailable`. A command line tool that
reads a run says so at once instead (`waiting_notice`: one plain line naming the URL and the deadline). On a cluster the
same deadline also covers CLUSTERDOWN, TRYAGAIN and a slot not covered yet (a failover in progress): each retry
re-reads the layout first (redis-py's cluster client does that on the error), so a command lands on the new primary.
A server that cannot write its AOF (its disk full) refuses every write with MISCONF until it can: that is waited out
the same way, under the same deadline (the refused command did nothing; the server retries its AOF write every
second and writes again once there is room), and past it the command raises `RedisRefusesWrites`, one line saying so.
Refusals are not outages and fail at once: refused credentials, an ACL denial (NOPERM), a TLS handshake that
fails (a bad certificate or CA, a TLS client on a plain port: no TLS answer within the connect timeout).
`refusal(error)` names which of these (or an outage past its deadline) an error is, `refusal_line` says it in one
line naming the URL with its password redacted (the command line prints it and exits 3).
Retrying is safe because every write the project makes is idempotent: appends dedupe by event id (events/store.py), XACK and
lease scripts are idempotent, and a consumer re-reads its own pending entries after a reconnect (events/consumer.py).
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from enum import StrEnum
from typing import Any, TypeVar, cast

import redis
import structlog
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.connection import Connection, ConnectionPool, SSLConnection, UnixDomainSocketConnection, parse_url
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    BusyLoadingError,
    ClusterDownError,
    ClusterError,
    ExternalAuthProviderError,
    MaxConnectionsError,
    NoPermissionError,
    NoScriptError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.retry import Retry
from redis.sentinel import Sentinel

from rolledger.events.keys import every_run_key
from rolledger.events.redact import redact

HEALTH_CHECK_INTERVAL_S = 30
DEADLINE_ENV = "ROLLEDGER_REDIS_DEADLINE_S"
DEFAULT_RETRY_DEADLINE_S = 60.0
RETRY_ON = (redis.ConnectionError, redis.TimeoutError, BusyLoadingError)
# ... and on a cluster: the cluster is down or a slot has no primary yet (a failover in progress), a slot is migrating
# (TRYAGAIN), a command redirected until redis-py gave up (ClusterError "TTL exhausted")
CLUSTER_RETRY_ON = (*RETRY_ON, ClusterDownError, ClusterError, SlotNotCoveredError, TryAgainError)
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
# Redis Sentinel: redis+sentinel://[user:password@]host:port[,host:port...]/MASTER_NAME[/db]. The hosts are sentinels;
# the credentials are the data servers' (the sentinels are asked without them). The client (redis-py's
# SentinelConnectionPool) asks the sentinels for the current primary on every (re)connect, and a connection to a
# primary that was demoted (READONLY) is dropped as a ConnectionError, so the outage retry lands on the new primary.
SENTINEL_SCHEME = "redis+sentinel"


class TlsHandshakeFailed(redis.ConnectionError):
    """The TCP connection was made but the TLS handshake over it failed: a certificate or CA the client refuses (or
    the server refuses the client's), or no TLS answer at all (a rediss:// URL naming a plain port). No wait cures it."""


# ConnectionError subclasses that no wait cures: credentials, permissions, TLS, the client's own pool limit
NOT_TRANSIENT = (
    AuthenticationError,
    AuthorizationError,
    ExternalAuthProviderError,
    MaxConnectionsError,
    TlsHandshakeFailed,
)

T = TypeVar("T")
_log = structlog.get_logger("redis")

# Where an outage is announced: None logs the warning "redis unavailable, retrying" (services); a command line tool
# that reads a run sets a printer (`waiting_notice`) and the outage is one plain line on its stderr instead.
_NOTICE: ContextVar[Callable[[str], None] | None] = ContextVar("redis_outage_notice", default=None)


@contextmanager
def waiting_notice(say: Callable[[str], None]) -> Iterator[None]:
    """While inside, an outage of a client used in this thread is announced through `say` (one line: the URL, the
    error, how long it will be waited out) instead of the log warning."""
    token = _NOTICE.set(say)
    try:
        yield
    finally:
        _NOTICE.reset(token)


def _tls_hint(url: str, cause: BaseException | None) -> str:
    """A hint for a plain redis:// client whose server hangs up on it at once: a TLS-only port does just that."""
    text = str(cause or "")
    if url.startswith(("redis://", "redis+cluster://")) and ("reset by peer" in text or "closed by server" in text):
        return "; if that port speaks TLS, use rediss://"
    return ""


class RedisUnavailable(redis.ConnectionError):
    """Redis stayed unreachable for the whole retry deadline."""

    def __init__(self, seconds: float, cause: BaseException, url: str = "") -> None:
        at = f" at {url}" if url else ""
        super().__init__(
            f"redis unreachable for {seconds:.0f} s{at} ({type(cause).__name__}: {cause}){_tls_hint(url, cause)}"
        )
        self.seconds = seconds
        self.url = url


class RedisRefusesWrites(RedisUnavailable):
    """Redis refused writes (MISCONF: it cannot write its AOF, e.g. its disk is full) for the whole retry deadline.
    Everything it acknowledged is still in its memory and AOF buffer, written out once its disk has room."""

    def __init__(self, seconds: float, cause: BaseException, url: str = "") -> None:
        redis.ConnectionError.__init__(
            self,
            f"redis{f' at {url}' if url else ''} refused writes for {seconds:.0f} s: "
            f"{' '.join(str(cause).split())} (free room on the disk of its AOF directory, CONFIG GET dir)",
        )
        self.seconds = seconds
        self.url = url


def refuses_writes(error: BaseException) -> bool:
    """Is this Redis's MISCONF, a refusal of every write until it can persist again (its AOF or RDB disk is full),
    also as a Lua script's or a pipeline's error?"""
    return isinstance(error, ResponseError) and "MISCONF " in str(error)


class Refusal(StrEnum):
    """Why Redis could not be used, when it is not a usage error: the first three fail at once."""

    AUTH = "auth"  # refused credentials (WRONGPASS, NOAUTH)
    NOPERM = "noperm"  # the ACL user may not run a command or touch a key
    TLS = "tls"  # the TLS handshake failed
    UNREACHABLE = "unreachable"  # an outage past the retry deadline


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or seen.__context__


def refusal(error: BaseException) -> Refusal | None:
    """Which refusal `error` (or an error it was raised from) is; None for anything else."""
    for e in _chain(error):
        text = str(e)
        if isinstance(e, RedisUnavailable):
            return Refusal.UNREACHABLE
        if isinstance(e, (AuthenticationError, AuthenticationWrongNumberOfArgsError, ExternalAuthProviderError)):
            return Refusal.AUTH
        if isinstance(e, redis.ResponseError) and text.startswith(("WRONGPASS", "NOAUTH")):
            return Refusal.AUTH
        if isinstance(e, (NoPermissionError, AuthorizationError)) or (
            isinstance(e, redis.ResponseError) and text.startswith("NOPERM")
        ):
            return Refusal.NOPERM
        if isinstance(e, (TlsHandshakeFailed, ssl.SSLError)) or (
            isinstance(e, redis.ConnectionError) and ("SSL" in text or "certificate" in text)
        ):
            return Refusal.TLS
    return None


def refusal_line(error: BaseException, url: str | None) -> str | None:
    """One line saying what Redis refused and what to check, naming `url` (redacted here); None when `error` is not
    a refusal (see `refusal`)."""
    kind = refusal(error)
    if kind is None:
        return None
    where = redact(url) if url else "the run's Redis"
    detail = " ".join(str(error).split())
    if kind is Refusal.UNREACHABLE:
        shown = detail if url is None or redact(url) in detail else f"{detail} (at {where})"
        return f"{shown}; {DEADLINE_ENV} sets how long to wait"
    if kind is Refusal.AUTH:
        return (
            f"redis {where} refused the credentials ({detail}): check the user and password in the URL or "
            "REDIS_USERNAME/REDIS_PASSWORD"
        )
    if kind is Refusal.NOPERM:
        return (
            f"redis {where}: the ACL user is not allowed this ({detail}): it needs the keys {every_run_key()} and "
            f"the commands a run uses (e.g. ACL SETUSER NAME on >PASSWORD ~{every_run_key()} +@all)"
        )
    return (
        f"redis {where}: TLS handshake failed ({detail}): check rediss:// against the server's tls-port and the CA "
        "that signed its certificate"
    )


def transient(error: BaseException) -> bool:
    """Is this failure an outage worth waiting out? Not: refused credentials, a TLS handshake or certificate failure
    (the server is up and says no)."""
    if isinstance(error, (RedisUnavailable, *NOT_TRANSIENT)):
        return False
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, ssl.SSLError) or "SSL" in str(seen) or "certificate" in str(seen):
            return False
        seen = seen.__cause__ or seen.__context__
    return True


def outages(client: redis.Redis) -> int:
    """How many outages this client has ridden out (or is in); 0 for a client `connect` did not make."""
    if isinstance(client, RedisCluster):
        retry = getattr(client, "outage_retry", None)
    else:
        retry = client.connection_pool.connection_kwargs.get("retry")
    return retry.outage.count if isinstance(retry, OutageRetry) else 0


def retry_deadline_s(given: float | None = None) -> float:
    """The outage deadline: `given`, else the environment's ROLLEDGER_REDIS_DEADLINE_S, else 60 s."""
    if given is not None:
        return given
    raw = os.environ.get(DEADLINE_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_RETRY_DEADLINE_S
    except ValueError:
        raise ValueError(f"{DEADLINE_ENV}={raw!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{DEADLINE_ENV}={raw!r} must be a positive, finite number of seconds")
    return value


class _Outage:
    """One client's outage bookkeeping, shared by every connection of its pool (one warning per outage)."""

    def __init__(self, url: str = "", deadline_s: float = DEFAULT_RETRY_DEADLINE_S) -> None:
        self.lock = threading.Lock()
        self.since: float | None = None  # monotonic time of the first failure of the current outage
        self.count = 0  # outages so far (a consumer re-reads its own pending entries after each)
        self.url = url  # redacted
        self.deadline_s = deadline_s

    def __deepcopy__(self, memo: dict[int, Any]) -> _Outage:  # redis-py deep-copies the retry per connection
        return self

    def failed(self, error: BaseException) -> float:
        with self.lock:
            if self.since is None:
                self.since = time.monotonic()
                self.count += 1
                cause = f"{type(error).__name__}: {error}"
                say = _NOTICE.get()
                if say is None:
                    _log.warning("redis unavailable, retrying", error=cause, url=self.url, deadline_s=self.deadline_s)
                else:
                    at = f" at {self.url}" if self.url else ""
                    say(
                        f"waiting for Redis{at} ({cause}){_tls_hint(self.url, error)}; giving up after "
                        f"{self.deadline_s:g} s ({DEADLINE_ENV})"
                    )
            return self.since

    def recovered(self) -> None:
        with self.lock:
            if self.since is not None:
                _log.info("redis available again", after_s=round(time.monotonic() - self.since, 1))
                self.since = None


class OutageRetry(Retry):
    """redis-py's Retry with exponential backoff, bounded by a deadline instead of a count."""

    def __init__(
        self,
        deadline_s: float,
        *,
        cap_s: float = 2.0,
        base_s: float = 0.05,
        errors: tuple[type[Exception], ...] = RETRY_ON,
        url: str = "",
    ) -> None:
        super().__init__(ExponentialBackoff(cap=cap_s, base=base_s), -1, errors)
        self.deadline_s = deadline_s
        self.url = redact(url) if url else ""
        self.outage = _Outage(self.url, deadline_s)

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        self._backoff.reset()
        failures = 0
        while True:
            try:
                result = do()
            except self._supported_errors as error:
                if not transient(error) or (is_retryable and not is_retryable(error)):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                since = self.outage.failed(error)
                waited = time.monotonic() - since
                if waited >= self.deadline_s:
                    raise RedisUnavailable(waited, error, self.url) from error
                time.sleep(min(self._backoff.compute(failures), max(0.0, self.deadline_s - waited)))
                continue
            except ResponseError as error:
                if not refuses_writes(error):
                    raise
                # MISCONF: the server could not write its AOF (its disk is full) and refuses every write until it
                # can; the refused command did nothing, and the connection is sound: wait, as for an outage
                failures += 1
                since = self.outage.failed(error)
                waited = time.monotonic() - since
                if waited >= self.deadline_s:
                    raise RedisRefusesWrites(waited, error, self.url) from error
                time.sleep(min(self._backoff.compute(failures), max(0.0, self.deadline_s - waited)))
                continue
            if failures or self.outage.since is not None:
                self.outage.recovered()
            return result


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


class RoleChanged(redis.ConnectionError):
    """A blocking read (XREAD/XREADGROUP BLOCK) cut short by its node turning replica in a failover (`-UNBLOCKED`):
    nothing was delivered, so it is retried like an outage, on the new layout."""


class SlotScript(Script):
    """A Lua script on a Redis Cluster: EVALSHA, and on NOSCRIPT the script itself with EVAL, routed by its keys'
    slot as EVALSHA is (which caches it on that node). redis-py's own fallback loads the script with SCRIPT LOAD and
    tries EVALSHA again, but after a failover the promoted replica's script cache is empty and SCRIPT LOAD may go to
    the nodes of a layout the client has not refreshed yet: the second EVALSHA failed too, and the worker with it."""

    def __call__(self, keys: Sequence[Any] | None = None, args: Iterable[Any] | None = None, client: Any = None) -> Any:
        keys, args = list(keys or []), tuple(args or ())
        target = client if client is not None else self.registered_client
        try:
            return target.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return target.eval(cast(str, self.script), len(keys), *keys, *args)


class ClusterClient(RedisCluster):
    """redis-py's RedisCluster whose commands ride out an outage (and a failover) like `connect`'s single-node client:
    every command goes through `outage_retry` (an `OutageRetry` over `CLUSTER_RETRY_ON`), on top of redis-py's own
    handling of MOVED/ASK redirections and one layout refresh per failed attempt."""

    def __init__(self, *, outage_retry: OutageRetry, **kwargs: Any) -> None:
        self.outage_retry = outage_retry  # first: the constructor already sends commands (COMMAND)
        # redis-py retries a failed command once itself, after re-reading the layout; the deadline is ours
        super().__init__(retry=Retry(NoBackoff(), 1), **kwargs)

    def register_script(self, script: Any) -> SlotScript:
        return SlotScript(self, script)

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        base = super().execute_command

        def attempt() -> Any:
            try:
                return base(*args, **kwargs)
            except ResponseError as exc:
                if not str(exc).startswith("UNBLOCKED"):
                    raise
                self.nodes_manager.initialize()  # the node turned replica: read the layout again, then retry
                raise RoleChanged(str(exc)) from exc

        return self.outage_retry.call_with_retry(attempt, _ignore)

    def at_key(self, key: str, *args: Any) -> Any:
        """Run a keyless command on the primary serving `key`'s slot (looked up again on every retry)."""
        base = super().execute_command
        return self.outage_retry.call_with_retry(lambda: base(*args, target_nodes=self.get_node_from_key(key)), _ignore)


def _ignore(*_: Any) -> None:
    pass


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

        client = outage.call_with_retry(start, _ignore)
        return cast(redis.Redis, client)  # see the module docstring: the commands the project sends, routed by key
    options["retry"] = OutageRetry(retry_deadline_s(retry_deadline), url=url)
    options["retry_on_error"] = list(RETRY_ON)
    if scheme == SENTINEL_SCHEME:
        service = options.pop("service_name")
        sentinels = Sentinel(
            nodes,
            sentinel_kwargs={"socket_connect_timeout": connect_timeout_s, "socket_timeout": connect_timeout_s},
        )
        return cast(redis.Redis, sentinels.master_for(service, redis_class=redis.Redis, **options))
    return redis.Redis(connection_pool=ConnectionPool(**options))
