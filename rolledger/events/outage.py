"""Riding out a Redis outage, for every client `events.connection.connect` makes: `OutageRetry` and the errors it
ends in.

Every command (and every connect) is retried through `OutageRetry`, redis-py's `Retry` with
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
Refusals are not outages and fail at once (`transient` tells them apart; events/refusal.py names them in one line).
Retrying is safe because every write the project makes is idempotent: appends dedupe by event id (events/store.py), XACK and
lease scripts are idempotent, and a consumer re-reads its own pending entries after a reconnect (events/consumer.py).
"""

from __future__ import annotations

import os
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import redis
import structlog
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    BusyLoadingError,
    ClusterDownError,
    ClusterError,
    ExternalAuthProviderError,
    MaxConnectionsError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.retry import Retry

from rolledger.events.redact import redact

DEADLINE_ENV = "ROLLEDGER_REDIS_DEADLINE_S"
DEFAULT_RETRY_DEADLINE_S = 60.0
RETRY_ON = (redis.ConnectionError, redis.TimeoutError, BusyLoadingError)
# ... and on a cluster: the cluster is down or a slot has no primary yet (a failover in progress), a slot is migrating
# (TRYAGAIN), a command redirected until redis-py gave up (ClusterError "TTL exhausted")
CLUSTER_RETRY_ON = (*RETRY_ON, ClusterDownError, ClusterError, SlotNotCoveredError, TryAgainError)


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


def no_op(*_: Any) -> None:
    """The `fail` callback of a retry with nothing to reset."""
