"""Which addresses rolledger will drive or serve on: owns the loopback/private-network guard for engine URLs and the
weight transport's host.

vLLM's RL and dev routes (/pause, /collective_rpc, /update_weight_version, ...) are unauthenticated even with
--api-key. rolledger therefore refuses to drive an engine whose address is not on the loopback range or a private
network (RFC 1918, IPv6 unique-local) unless the run explicitly says `allow_remote_engines`. Host names are resolved
and every address they resolve to must pass: a name that resolves to one private and one public address is refused.
Link-local addresses (169.254.0.0/16, fe80::/10: cloud metadata services) are not "private" here.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from rolledger.events.redact import redact

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

ALLOWED_NETWORKS: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("10.0.0.0/8"),
    ipaddress.ip_network("172.16.0.0/12"),
    ipaddress.ip_network("192.168.0.0/16"),
    ipaddress.ip_network("::1/128"),
    ipaddress.ip_network("fc00::/7"),
)


class EngineAddressError(ValueError):
    """An engine URL is malformed, cannot be resolved, or points outside loopback/private networks."""


@dataclass(frozen=True)
class CheckedAddress:
    """What the guard saw: the host of the URL and every address it resolved to."""

    url: str
    host: str
    port: int | None
    addresses: tuple[str, ...]
    remote: bool  # True when at least one address is outside the allowed networks (only with allow_remote)


def is_allowed_ip(addr: IPAddress) -> bool:
    """True for loopback and private-range addresses (IPv4-mapped IPv6 is judged by its IPv4 address)."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return any(addr.version == net.version and addr in net for net in ALLOWED_NETWORKS)


def _resolve(host: str, port: int | None) -> tuple[IPAddress, ...]:
    try:
        return (ipaddress.ip_address(host.strip("[]")),)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise EngineAddressError(f"engine host {host!r} cannot be resolved: {e}") from e
    out: list[IPAddress] = []
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if ip not in out:
            out.append(ip)
    if not out:
        raise EngineAddressError(f"engine host {host!r} resolved to no address")
    return tuple(out)


def _guard(addresses: tuple[IPAddress, ...], allow_remote: bool, refusal: Callable[[str], str]) -> bool:
    """Whether any of `addresses` is outside the allowed networks; EngineAddressError(`refusal(those addresses)`)
    when one is and `allow_remote` is off."""
    outside = [a for a in addresses if not is_allowed_ip(a)]
    if outside and not allow_remote:
        raise EngineAddressError(refusal(", ".join(map(str, outside))))
    return bool(outside)


def check_engine_address(url: str, allow_remote: bool) -> CheckedAddress:
    """Validate an engine base URL; raise EngineAddressError unless every address is loopback/private.

    With `allow_remote=True` public addresses pass (the result says `remote=True`), but the URL must still be a
    well-formed http(s) URL whose host resolves.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise EngineAddressError(f"engine url {redact(url)!r}: scheme must be http or https, got {parts.scheme!r}")
    host = parts.hostname
    if not host:
        raise EngineAddressError(f"engine url {redact(url)!r} has no host")
    try:
        port = parts.port
    except ValueError as e:
        raise EngineAddressError(f"engine url {redact(url)!r}: bad port: {e}") from e
    addresses = _resolve(host, port)
    remote = _guard(
        addresses,
        allow_remote,
        lambda outside: (
            f"engine url {redact(url)!r}: host {host!r} resolves to {outside}, outside loopback and "
            "private networks. vLLM's RL routes (/pause, /collective_rpc, /update_weight_version) are "
            "unauthenticated; bind the server to a private network, or set allow_remote_engines=true to accept "
            "the risk."
        ),
    )
    return CheckedAddress(url=url, host=host, port=port, addresses=tuple(map(str, addresses)), remote=remote)


def check_host(host: str, allow_remote: bool, what: str = "weight server") -> tuple[str, ...]:
    """The same guard for a bare host another rolledger part listens on or connects to (the weight transport's
    server): every address it resolves to must be loopback/private unless `allow_remote`; returns the addresses."""
    addresses = _resolve(host, None)
    _guard(
        addresses,
        allow_remote,
        lambda outside: (
            f"{what} host {host!r} resolves to {outside}, outside loopback and private networks; the "
            "weight transport is unauthenticated: use a private address, or set update.allow_remote_transport=true to "
            "accept the risk"
        ),
    )
    return tuple(map(str, addresses))
