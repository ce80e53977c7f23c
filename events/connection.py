"""Redis connections for every rolledger process: one function from a URL (and credentials, TLS files) to a client.

URLs: `redis://[user:password@]host:port/db`, `rediss://...` (TLS), `unix:///path/to/redis.sock[?db=N]`.
Credentials, first found wins: the `username`/`password` arguments, then the URL's user info, then the
`REDIS_USERNAME`/`REDIS_PASSWORD` environment variables. Clients return bytes (`decode_responses=False`: the event
codec needs the raw bytes), check idle connections with a PING every `health_check_interval` seconds, and fail a
connect after `connect_timeout_s` rather than hanging. Reads have no socket timeout, so XREAD/XREADGROUP BLOCK
(bounded by their own block_ms) are not cut short.
"""

from __future__ import annotations

import os
from typing import Any

import redis
from redis.connection import ConnectionPool, SSLConnection, UnixDomainSocketConnection, parse_url

HEALTH_CHECK_INTERVAL_S = 30


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
) -> redis.Redis:
    """A redis.Redis for `url` (redis://, rediss://, unix://). Raises ValueError naming what is wrong with the input.

    tls_ca: CA bundle to verify the server with (default: the system store); tls_cert/tls_key: client certificate
    and key for servers with `tls-auth-clients yes`; tls_insecure: skip certificate and host name verification
    (tests, self-signed lab setups only). TLS options with a redis:// or unix:// URL are an error.
    """
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"redis url {url!r}: scheme must be redis://, rediss:// or unix://")
    options: dict[str, Any] = parse_url(url)
    if scheme == "unix" and not options.get("path"):
        raise ValueError(f"redis url {url!r}: unix:// needs a socket path, e.g. unix:///run/redis.sock")
    if scheme != "unix" and not options.get("host"):
        options["host"] = "localhost"

    tls_given = [n for n, v in (("tls_ca", tls_ca), ("tls_cert", tls_cert), ("tls_key", tls_key)) if v]
    if tls_insecure:
        tls_given.append("tls_insecure")
    if scheme != "rediss" and tls_given:
        raise ValueError(f"{', '.join(tls_given)} given but redis url {url!r} is not rediss:// (TLS)")
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
    if scheme != "unix":
        options["socket_keepalive"] = True
    return redis.Redis(connection_pool=ConnectionPool(**options))
