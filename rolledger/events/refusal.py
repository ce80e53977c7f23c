"""Why Redis could not be used, when it is not a usage error, said in one line (the command line prints it and
exits 3).

Refusals are not outages and fail at once: refused credentials, an ACL denial (NOPERM), a TLS handshake that
fails (a bad certificate or CA, a TLS client on a plain port: no TLS answer within the connect timeout).
`refusal(error)` names which of these (or an outage past its deadline: `RedisUnavailable`, events/outage.py) an
error is, `refusal_line` says it in one line naming the URL with its password redacted.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from enum import StrEnum

import redis
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    ExternalAuthProviderError,
    NoPermissionError,
)

from rolledger.events.keys import every_run_key
from rolledger.events.outage import DEADLINE_ENV, RedisUnavailable, TlsHandshakeFailed
from rolledger.events.redact import redact


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
