"""events.connection against real redis-servers started here: passwords, ACL users, unix sockets, TLS with a CA and
client certificates made on the spot; bad input is refused naming what is wrong."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from rolledger.events.connection import connect
from rolledger.events.embedded import find_redis_server

PASSWORD = "s3cret-pw"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A private redis-server with extra arguments, on a free port (never 6379), stopped by the fixture."""

    def __init__(self, workdir: Path, *args: str) -> None:
        self.workdir = workdir
        self.port = _free_port()
        self.sock = Path(tempfile.mkdtemp(prefix="rl-conn-")) / "r.sock"
        argv = [
            str(find_redis_server()),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--unixsocket",
            str(self.sock),
            "--logfile",
            str(workdir / "redis.log"),
            *args,
        ]
        if "--port" not in args:
            argv += ["--port", str(self.port)]
        with open(workdir / "stderr.txt", "wb") as err:  # config errors go to stderr, not the log file
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 20
        while not self.sock.exists():  # the unix socket appears once the server listens
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                logs = [
                    (workdir / n).read_text(errors="replace")[-1500:]
                    for n in ("stderr.txt", "redis.log")
                    if (workdir / n).exists()
                ]
                raise RuntimeError(f"redis-server did not start: {' '.join(logs)}")
            time.sleep(0.01)  # polling readiness with a deadline

    def admin(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.sock), password=PASSWORD)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.sock.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("auth"), "--requirepass", PASSWORD)
    admin = server.admin()
    admin.execute_command("ACL", "SETUSER", "alice", "on", ">alice-pw", "~rolledger:*", "+@all")
    admin.close()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _no_env_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_PASSWORD", raising=False)
    monkeypatch.delenv("REDIS_USERNAME", raising=False)


def test_password_in_url(auth_server: Server) -> None:
    client = connect(f"redis://:{PASSWORD}@127.0.0.1:{auth_server.port}/0")
    assert client.ping()
    assert client.set("k", b"\xff\x00") and client.get("k") == b"\xff\x00"  # bytes, not decoded
    client.close()


def test_password_argument_beats_url_and_env(auth_server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_PASSWORD", "wrong-from-env")
    client = connect(f"redis://:wrong-in-url@127.0.0.1:{auth_server.port}", password=PASSWORD)
    assert client.ping()
    client.close()


def test_password_from_env(auth_server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_PASSWORD", PASSWORD)
    client = connect(f"redis://127.0.0.1:{auth_server.port}")
    assert client.ping()
    client.close()


def test_missing_or_wrong_password_refused(auth_server: Server) -> None:
    with pytest.raises(redis.AuthenticationError):
        connect(f"redis://127.0.0.1:{auth_server.port}").ping()
    with pytest.raises(redis.AuthenticationError):
        connect(f"redis://127.0.0.1:{auth_server.port}", password="nope").ping()


def test_acl_user_in_url_kwargs_and_env(auth_server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    by_url = connect(f"redis://alice:alice-pw@127.0.0.1:{auth_server.port}/0")
    assert by_url.acl_whoami() == "alice"
    assert by_url.set("rolledger:{r}:x", b"1")
    with pytest.raises(redis.exceptions.NoPermissionError):
        by_url.set("other:key", b"1")  # outside alice's key pattern
    by_url.close()
    by_args = connect(f"redis://127.0.0.1:{auth_server.port}", username="alice", password="alice-pw")
    assert by_args.acl_whoami() == "alice"
    by_args.close()
    monkeypatch.setenv("REDIS_USERNAME", "alice")
    monkeypatch.setenv("REDIS_PASSWORD", "alice-pw")
    by_env = connect(f"redis://127.0.0.1:{auth_server.port}")
    assert by_env.acl_whoami() == "alice"
    by_env.close()
    with pytest.raises(redis.AuthenticationError):
        connect(f"redis://alice:bad@127.0.0.1:{auth_server.port}").ping()


def test_unix_socket_url(auth_server: Server) -> None:
    client = connect(f"unix://{auth_server.sock}?db=2", password=PASSWORD)
    assert client.ping()
    assert client.connection_pool.connection_kwargs["db"] == 2
    client.close()


@pytest.mark.parametrize(
    ("url", "kwargs", "message"),
    [
        (
            "http://127.0.0.1:1",
            {},
            "scheme must be redis://, rediss://, unix://, redis\\+cluster:// or rediss\\+cluster://",
        ),
        ("127.0.0.1:6380", {}, "scheme must be"),
        ("unix://", {}, "needs a socket path"),
        ("redis://127.0.0.1:1", {"tls_ca": "/ca.pem"}, "tls_ca given but redis url"),
        ("unix:///tmp/x.sock", {"tls_insecure": True}, "tls_insecure given"),
        ("rediss://127.0.0.1:1", {"tls_cert": "/c.pem"}, "tls_cert and tls_key must be given together"),
        ("redis://127.0.0.1:1", {"username": "alice"}, "username 'alice' given without a password"),
    ],
)
def test_bad_input_named(url: str, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        connect(url, **kwargs)


def test_client_settings() -> None:
    client = connect("redis://127.0.0.1:1")
    kw = client.connection_pool.connection_kwargs
    assert kw["decode_responses"] is False and kw["health_check_interval"] > 0
    assert client.connection_pool.connection_class is redis.connection.Connection


# ------------------------------------------------------------------------------------------------------------ TLS
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_pki(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all signed by the CA."""
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=rolledger-test-ca",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            cwd=d,
        )


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make the test certificates)")
    pki = tmp_path_factory.mktemp("pki")
    _make_pki(pki)
    port = _free_port()
    try:
        server = Server(
            tmp_path_factory.mktemp("tls"),
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(pki / "server.crt"),
            "--tls-key-file",
            str(pki / "server.key"),
            "--tls-ca-cert-file",
            str(pki / "ca.crt"),
            "--tls-auth-clients",
            "yes",
            "--requirepass",
            PASSWORD,
        )
    except RuntimeError as exc:
        if "Bad directive" in str(exc) and "tls-port" in str(exc):  # the build has no TLS at all
            pytest.skip(f"{find_redis_server()} was built without TLS support: {exc}")
        raise
    server.port = port
    yield server, pki
    server.stop()


def test_rediss_url_gives_an_ssl_connection_class() -> None:
    client = connect("rediss://127.0.0.1:1", tls_ca="/nonexistent-ca.pem")
    assert issubclass(client.connection_pool.connection_class, redis.connection.SSLConnection)
    kw = client.connection_pool.connection_kwargs
    assert kw["ssl_ca_certs"] == "/nonexistent-ca.pem" and kw["ssl_cert_reqs"] == "required"
    assert kw["ssl_check_hostname"] is True


def test_tls_with_ca_and_client_certificate(tls_server: tuple[Server, Path]) -> None:
    server, pki = tls_server
    client = connect(
        f"rediss://127.0.0.1:{server.port}",
        password=PASSWORD,
        tls_ca=str(pki / "ca.crt"),
        tls_cert=str(pki / "client.crt"),
        tls_key=str(pki / "client.key"),
    )
    assert client.ping()
    client.close()


def test_tls_without_client_certificate_refused(tls_server: tuple[Server, Path]) -> None:
    server, pki = tls_server
    with pytest.raises(redis.ConnectionError):
        connect(f"rediss://127.0.0.1:{server.port}", password=PASSWORD, tls_ca=str(pki / "ca.crt")).ping()


def test_tls_unknown_ca_refused_unless_insecure(tls_server: tuple[Server, Path]) -> None:
    server, pki = tls_server
    with pytest.raises(redis.ConnectionError):  # the system store does not know our test CA
        connect(
            f"rediss://127.0.0.1:{server.port}",
            password=PASSWORD,
            tls_cert=str(pki / "client.crt"),
            tls_key=str(pki / "client.key"),
        ).ping()
    client = connect(
        f"rediss://127.0.0.1:{server.port}",
        password=PASSWORD,
        tls_insecure=True,
        tls_cert=str(pki / "client.crt"),
        tls_key=str(pki / "client.key"),
    )
    assert client.ping()
    client.close()
