"""Redis connections for every rolledger process: one function from a URL (and credentials, TLS files) to a client.

URLs: `redis://[user:password@]host:port/db`, `rediss://...` (TLS), `unix:///path/to/redis.sock[?db=N]`.
Credentials, first found wins: the `username`/`password` arguments, then the URL's user info, then the
`REDIS_USERNAME`/`REDIS_PASSWORD` environment variables. Clients return bytes (`decode_responses=False`: the event
codec needs the raw bytes), check idle connections with a PING every `health_check_interval` seconds, and fail a
connect after `connect_timeout_s` rather than hanging. Reads have no socket timeout, so XREAD/XREADGROUP BLOCK
(bounded by their own block_ms) are not cut short.

Outages: every command (and every connect) is retried through `OutageRetry`, redis-py's `Retry` with
`ExponentialBackoff` on ConnectionError / TimeoutError / BusyLoadingError (a server restarting over its AOF answers
LOADING), for up to `retry_deadline_s` (argument, else `ROLLEDGER_REDIS_DEADLINE_S`, default 60 s) from the first
failure. An outage logs one warning ("redis unavailable, retrying") and one line when Redis is back, whatever the
number of threads and connections. When the deadline runs out the command raises `RedisUnavailable`. Retrying is
safe because every write the project makes is idempotent: appends dedupe by event id (events/store.py), XACK and
lease scripts are idempotent, and a consumer re-reads its own pending entries after a reconnect (events/consumer.py).
"""

from __future__ import annotations

import os
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
import structlog
from redis.backoff import ExponentialBackoff
from redis.connection import ConnectionPool, SSLConnection, UnixDomainSocketConnection, parse_url
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    BusyLoadingError,
    ExternalAuthProviderError,
    MaxConnectionsError,
)
from redis.retry import Retry

from rolledger.events.redact import redact

HEALTH_CHECK_INTERVAL_S = 30
DEADLINE_ENV = "ROLLEDGER_REDIS_DEADLINE_S"
DEFAULT_RETRY_DEADLINE_S = 60.0
RETRY_ON = (redis.ConnectionError, redis.TimeoutError, BusyLoadingError)

# ConnectionError subclasses that no wait cures: credentials, permissions, the client's own pool limit
NOT_TRANSIENT = (AuthenticationError, AuthorizationError, ExternalAuthProviderError, MaxConnectionsError)

T = TypeVar("T")
_log = structlog.get_logger("redis")


class RedisUnavailable(redis.ConnectionError):
    """Redis stayed unreachable for the whole retry deadline."""

    def __init__(self, seconds: float, cause: BaseException) -> None:
        super().__init__(f"redis unreachable for {seconds:.0f} s ({type(cause).__name__}: {cause})")
        self.seconds = seconds


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

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.since: float | None = None  # monotonic time of the first failure of the current outage
        self.count = 0  # outages so far (a consumer re-reads its own pending entries after each)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Outage:  # redis-py deep-copies the retry per connection
        return self

    def failed(self, error: BaseException) -> float:
        with self.lock:
            if self.since is None:
                self.since = time.monotonic()
                self.count += 1
                _log.warning("redis unavailable, retrying", error=f"{type(error).__name__}: {error}")
            return self.since

    def recovered(self) -> None:
        with self.lock:
            if self.since is not None:
                _log.info("redis available again", after_s=round(time.monotonic() - self.since, 1))
                self.since = None


class OutageRetry(Retry):
    """redis-py's Retry with exponential backoff, bounded by a deadline instead of a count."""

    def __init__(self, deadline_s: float, *, cap_s: float = 2.0, base_s: float = 0.05) -> None:
        super().__init__(ExponentialBackoff(cap=cap_s, base=base_s), -1, RETRY_ON)
        self.deadline_s = deadline_s
        self.outage = _Outage()

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
                    raise RedisUnavailable(waited, error) from error
                time.sleep(min(self._backoff.compute(failures), max(0.0, self.deadline_s - waited)))
                continue
            if failures or self.outage.since is not None:
                self.outage.recovered()
            return result


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
    """A redis.Redis for `url` (redis://, rediss://, unix://). Raises ValueError naming what is wrong with the input.

    tls_ca: CA bundle to verify the server with (default: the system store); tls_cert/tls_key: client certificate
    and key for servers with `tls-auth-clients yes`; tls_insecure: skip certificate and host name verification
    (tests, self-signed lab setups only). TLS options with a redis:// or unix:// URL are an error.
    retry_deadline: how long an outage is ridden out (seconds; default: see `retry_deadline_s`).
    """
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"redis url {redact(url)!r}: scheme must be redis://, rediss:// or unix://")
    options: dict[str, Any] = parse_url(url)
    if scheme == "unix" and not options.get("path"):
        raise ValueError(f"redis url {redact(url)!r}: unix:// needs a socket path, e.g. unix:///run/redis.sock")
    if scheme != "unix" and not options.get("host"):
        options["host"] = "localhost"

    tls_given = [n for n, v in (("tls_ca", tls_ca), ("tls_cert", tls_cert), ("tls_key", tls_key)) if v]
    if tls_insecure:
        tls_given.append("tls_insecure")
    if scheme != "rediss" and tls_given:
        raise ValueError(f"{', '.join(tls_given)} given but redis url {redact(url)!r} is not rediss:// (TLS)")
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert and tls_key must be given together (client certificate and its key)")

    user = username or options.pop("username", None) or os.environ.get("REDIS_USERNAME") or None
    secret = password or options.pop("password", None) or os.environ.get("REDIS_PASSWORD") or None
    if user and not secret:
        raise ValueError(f"redis username {user!r} given without a password (arguments, URL or REDIS_PASSWORD)")
    options["username"] = user
    options["password"] = secret

    if scheme == "rediss":
        options["connection_class"] = SSLConnection
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
    options["retry"] = OutageRetry(retry_deadline_s(retry_deadline))
    options["retry_on_error"] = list(RETRY_ON)
    if scheme != "unix":
        options["socket_keepalive"] = True
    return redis.Redis(connection_pool=ConnectionPool(**options))
