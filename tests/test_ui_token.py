"""`rolledger ui --allow-remote`: every request needs the page's token (generated and printed at start, or given in
a file or $ROLLEDGER_UI_TOKEN), as a Bearer header or the cookie a `?token=` link sets; 401 without it. Served on
0.0.0.0 and asked on 127.0.0.1, over real HTTP, against the test redis with a committed fixture log in it; the
page's own fetches in a real Chromium where one is installed."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from cdp import Browser, find_chromium

from rolledger.events.codec import decode
from rolledger.events.keys import log_key
from rolledger.events.scan import scan_log
from rolledger.events.store import PAYLOAD_FIELD, TYPE_FIELD
from rolledger.workers.operator.cli import main
from rolledger.workers.operator.ui_server import TOKEN_COOKIE, TOKEN_ENV, UiRefused, UiServer, serve, ui_token

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
from history import load_entries

TOKEN = "t0ken-for-the-test-0123456789"


def load_clean(client: redis.Redis, run_id: str) -> None:
    _fixture_run, entries = load_entries("clean")
    for sid, raw in entries:
        client.xadd(log_key(run_id), {PAYLOAD_FIELD: raw, TYPE_FIELD: decode(raw).type}, id=sid)


def get(port: int, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    """One GET to 127.0.0.1:port (no redirect followed), its body read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp


@pytest.fixture
def remote(redis_client: redis.Redis, run_id: str) -> Iterator[UiServer]:
    """The page's server on 0.0.0.0 (all addresses), allow_remote, with TOKEN."""
    load_clean(redis_client, run_id)
    server = serve(redis_client, run_id, "0.0.0.0", 0, scan_log, allow_remote=True, token=TOKEN)
    thread = threading.Thread(target=server.serve_forever, name="ui-token-test", daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def test_a_request_without_the_token_is_401_and_one_with_it_is_served(remote: UiServer) -> None:
    port = int(remote.server_address[1])
    for path in ("/", "/api/view", "/api/events", "/api/lineage?id=g000001/0", "/nothing"):
        refused = get(port, path)
        assert refused.status == 401 and "Bearer" in (refused.getheader("WWW-Authenticate") or ""), path
    assert get(port, "/api/view", {"Authorization": "Bearer wrong-token-0123456789"}).status == 401
    assert get(port, "/api/view", {"Authorization": f"Basic {TOKEN}"}).status == 401
    assert get(port, "/api/view", {"Cookie": f"{TOKEN_COOKIE}=nope"}).status == 401
    assert get(port, "/api/view?token=nope").status == 401
    assert get(port, "/api/view", {"Authorization": f"Bearer {TOKEN}"}).status == 200
    assert get(port, "/", {"Authorization": f"Bearer {TOKEN}"}).status == 200


def test_a_token_link_sets_the_cookie_the_pages_fetches_then_carry(remote: UiServer) -> None:
    """What a browser does: open ?token=..., follow the redirect (the token gone from the address), then fetch the
    API with the cookie alone."""
    port = int(remote.server_address[1])
    link = get(port, f"/?token={TOKEN}")
    assert link.status == 303 and link.getheader("Location") == "/"
    cookie = link.getheader("Set-Cookie") or ""
    assert cookie.startswith(f"{TOKEN_COOKIE}={TOKEN};") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    jar = {"Cookie": cookie.split(";", 1)[0]}
    assert get(port, "/", jar).status == 200
    assert get(port, "/api/view?since=0", jar).status == 200
    kept = get(port, f"/api/events?type=UpdatePublished&token={TOKEN}")
    assert kept.status == 303 and kept.getheader("Location") == "/api/events?type=UpdatePublished"


def test_the_token_comes_from_a_file_the_environment_or_is_generated(tmp_path: Path) -> None:
    assert ui_token(False, None, {}) is None  # loopback, nothing given: no token asked (as before)
    generated = ui_token(True, None, {})
    assert generated is not None and generated.source == "generated" and len(generated.value) >= 40
    assert ui_token(True, None, {}) != generated  # a new one each start
    assert ui_token(True, None, {TOKEN_ENV: f" {TOKEN}\n"}) == type(generated)(TOKEN, "env")
    (tmp_path / "tok").write_text(f"{TOKEN}\nignored\n")
    assert ui_token(True, str(tmp_path / "tok"), {TOKEN_ENV: "other-token-0123456789"}) == type(generated)(
        TOKEN, "file"
    )
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(UiRefused, match="at least 16 characters"):
        ui_token(True, str(tmp_path / "short"), {})
    with pytest.raises(UiRefused, match="cannot read it"):
        ui_token(True, str(tmp_path / "missing"), {})


def test_a_bad_token_file_is_one_line_exit_2(
    redis_url: str, run_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["ui", run_id, "--redis", redis_url, "--host", "0.0.0.0", "--allow-remote"]
    assert main([*argv, "--token-file", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rolledger ui: --token-file") and "cannot read it" in err[0], err


def _serve_ui(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rolledger.workers.operator.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline()  # the URL, as one line, once it serves (EOF if it exited)


def _stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return err


def test_the_command_on_0_0_0_0_prints_a_generated_token_and_asks_for_it(
    redis_url: str, run_id: str, redis_client: redis.Redis
) -> None:
    load_clean(redis_client, run_id)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop(TOKEN_ENV, None)
    argv = ["ui", run_id, "--redis", redis_url, "--host", "0.0.0.0", "--allow-remote", "--port", "0"]
    proc, line = _serve_ui(argv, env)
    try:
        url = line.split()[0]
        assert url.startswith("http://0.0.0.0:") and "?token=" in url and "token generated" in line, line
        port = int(url.split(":")[2].split("/")[0])
        token = url.split("?token=", 1)[1]
        assert get(port, "/api/view").status == 401
        assert get(port, "/api/view", {"Authorization": f"Bearer {token}"}).status == 200
    finally:
        err = _stop(proc)
    assert proc.returncode == 130 and "Traceback" not in err, err
    # a token given in the environment is checked, and never printed
    proc, line = _serve_ui(argv, {**env, TOKEN_ENV: TOKEN})
    try:
        assert TOKEN not in line and f"${TOKEN_ENV}" in line, line
        port = int(line.split()[0].split(":")[2].split("/")[0])
        assert get(port, "/api/view").status == 401
        assert get(port, "/api/view", {"Authorization": f"Bearer {TOKEN}"}).status == 200
    finally:
        err = _stop(proc)
    assert proc.returncode == 130 and TOKEN not in err, err


def test_the_page_keeps_working_in_a_browser_after_a_token_link(remote: UiServer, tmp_path: Path) -> None:
    binary = find_chromium()
    if binary is None:
        pytest.skip(
            "no Chromium found (apt-get install chromium, or set ROLLEDGER_CHROMIUM); the page is untested here"
        )
    browser = Browser(binary, tmp_path / "profile")
    try:
        page = browser.page(f"http://127.0.0.1:{remote.server_address[1]}/?token={TOKEN}")
        page.wait_for("document.querySelector('#status').dataset.status === 'completed'")
        page.wait_for("document.querySelectorAll('#events tbody tr').length === 188")
        assert page.evaluate("location.search") == ""  # the token left the address bar
        page.close()
        assert not browser.errors, browser.errors
    finally:
        browser.close()


def test_loopback_without_a_token_is_served_as_before(redis_url: str, run_id: str, redis_client: redis.Redis) -> None:
    load_clean(redis_client, run_id)
    server = serve(redis_client, run_id, "127.0.0.1", 0, scan_log)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        resp = get(int(server.server_address[1]), "/api/view")
        assert resp.status == 200 and server.token is None
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
