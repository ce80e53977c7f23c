"""workers.runtime.netguard: engine URLs outside loopback/private networks are refused unless allowed explicitly."""

from __future__ import annotations

import ipaddress

import pytest

from rolledger.workers.runtime.netguard import EngineAddressError, check_engine_address, is_allowed_ip


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000",
        "http://127.8.9.10:1",
        "http://localhost:8000/",
        "http://[::1]:8000",
        "http://10.1.2.3:8000",
        "http://172.16.0.5:8000",
        "http://172.31.255.254:8000",
        "https://192.168.1.20",
        "http://[fd12:3456::1]:8000",
    ],
)
def test_loopback_and_private_allowed(url: str) -> None:
    checked = check_engine_address(url, allow_remote=False)
    assert checked.remote is False
    assert checked.addresses


@pytest.mark.parametrize(
    "url",
    [
        "http://8.8.8.8:8000",
        "http://172.32.0.1:8000",  # just outside 172.16/12
        "http://169.254.169.254/",  # link-local: cloud metadata, not private
        "http://100.64.0.1:8000",  # carrier-grade NAT is not RFC 1918
        "http://[2001:db8::1]:8000",
        "http://[::ffff:8.8.8.8]:8000",  # IPv4-mapped public address
    ],
)
def test_public_refused_with_reason(url: str) -> None:
    with pytest.raises(EngineAddressError, match="outside loopback and private networks"):
        check_engine_address(url, allow_remote=False)


def test_public_allowed_when_remote_allowed() -> None:
    checked = check_engine_address("http://8.8.8.8:8000", allow_remote=True)
    assert checked.remote is True
    assert checked.addresses == ("8.8.8.8",)
    assert checked.port == 8000


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("ftp://127.0.0.1/", "scheme must be http"),
        ("127.0.0.1:8000", "scheme must be http"),
        ("http:///path", "has no host"),
        ("http://127.0.0.1:99999", "bad port"),
        ("http://no-such-host.invalid:8000", "cannot be resolved"),
    ],
)
def test_malformed_urls_named(url: str, fragment: str) -> None:
    with pytest.raises(EngineAddressError, match=fragment):
        check_engine_address(url, allow_remote=True)


def test_ipv4_mapped_private_is_allowed() -> None:
    assert is_allowed_ip(ipaddress.ip_address("::ffff:10.0.0.1"))
    assert not is_allowed_ip(ipaddress.ip_address("::ffff:1.1.1.1"))
