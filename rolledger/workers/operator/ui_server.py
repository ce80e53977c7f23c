"""`rolledger ui RUN`: a live web page for one run, served from its log over HTTP (stdlib `http.server`).

One static page (`ui_page.html`, inline JS and CSS, no build step, nothing fetched from elsewhere) polls JSON
endpoints about once a second:

- `GET /api/view?since=CURSOR`: status, timeline (lanes, lag histogram, queue) and curves; `{"unchanged": true}`
  when the log has not moved past CURSOR;
- `GET /api/events?type=T&group=G&rank=R&version=V&limit=N`: the event list, filtered;
- `GET /api/lineage?id=TRAJECTORY_OR_GROUP`: the lineage of a trajectory (or of a group's first one), 404 if none.

Every request first reads the entries appended since the last one (XRANGE from the last stream id seen: reads
only, nothing is written into the run's Redis) into a `workflows.ui_view.RunView`. The server binds loopback only
unless `allow_remote`; without it, requests whose Host header names another host are refused (DNS rebinding).

With `allow_remote` every request needs the page's token (`ui_token`: read from a file, or from `ROLLEDGER_UI_TOKEN`,
else generated with `secrets.token_urlsafe` and printed in the URL at start; never an argument, which `ps` would show):
an `Authorization: Bearer TOKEN` header, or the cookie a `?token=TOKEN` link sets (answered with a redirect to the
same page without it, so the token leaves the address bar; the page's own fetches then carry the cookie). Compared
with `hmac.compare_digest`; anything else is 401. A token given on loopback is checked the same way.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import os
import re
import secrets
import signal
import socket
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import redis
import structlog

from rolledger.events.redact import MASK, redact
from rolledger.workflows.replay import position
from rolledger.workflows.ui_view import RunView, parse_filter

if TYPE_CHECKING:
    from rolledger.events.scan import LogScan

log = structlog.get_logger("rolledger.ui")

Scan = Callable[["redis.Redis", str, str], "LogScan"]

TOKEN_ENV = "ROLLEDGER_UI_TOKEN"
TOKEN_COOKIE = "rolledger_ui_token"
MIN_TOKEN_CHARS = 16


class UiRefused(ValueError):
    """The page cannot be served as asked: a --host that is not loopback (without allow_remote) or does not
    resolve, a busy port. One line, for the command line to print."""


@dataclass(frozen=True)
class UiToken:
    """The page's token and where it came from: "file", "env" or "generated" (only a generated one is printed)."""

    value: str
    source: str


def ui_token(allow_remote: bool, token_file: str | None, environ: dict[str, str] | None = None) -> UiToken | None:
    """The token every request must carry: the --token-file's first line, else $ROLLEDGER_UI_TOKEN, else (with
    `allow_remote`) a new one; None on loopback with neither given. A UiRefused for a file that cannot be read or a
    token too short to guess at."""
    env = os.environ if environ is None else environ
    token: UiToken | None = None
    if token_file is not None:
        try:
            lines = Path(token_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise UiRefused(f"--token-file {token_file}: cannot read it ({exc})") from None
        token = UiToken(lines[0].strip() if lines else "", "file")
        what = f"--token-file {token_file}"
    elif env.get(TOKEN_ENV):
        token = UiToken(env[TOKEN_ENV].strip(), "env")
        what = f"${TOKEN_ENV}"
    elif allow_remote:
        return UiToken(secrets.token_urlsafe(32), "generated")
    if token is not None and len(token.value) < MIN_TOKEN_CHARS:
        raise UiRefused(
            f"{what}: the token must be at least {MIN_TOKEN_CHARS} characters, e.g. "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return token


class LiveLog:
    """A run's log as read so far, and the view of it; `refresh` reads what was appended since (thread-safe)."""

    def __init__(
        self, client: redis.Redis, run_id: str, scan: Scan, reopen: Callable[[], redis.Redis] | None = None
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.scan = scan
        self.reopen = reopen  # a fresh client when this one's Redis went away (a live run that ended: its AOF)
        self.view = RunView()
        self.last_id: str | None = None
        self.lock = threading.Lock()

    def refresh(self) -> None:
        with self.lock:
            if self.view.state.status.is_terminal:
                return  # nothing is appended after RunFinished (and a finished run's Redis may be gone)
            start = "-" if self.last_id is None else "(" + self.last_id
            try:
                found = self.scan(self.client, self.run_id, start)
            except redis.ConnectionError:
                if self.reopen is None:
                    raise
                self.client = self.reopen()
                found = self.scan(self.client, self.run_id, start)
            ids: list[str] = [u.stream_id for u in found.undecodable]
            for entry in found.entries:
                self.view.add(entry.stream_id, entry.event)
                ids.append(entry.stream_id)
            self.view.undecodable += len(found.undecodable)
            if ids:
                newest = max(ids, key=position)
                if self.last_id is None or position(newest) > position(self.last_id):
                    self.last_id = newest


def page_html() -> str:
    return resources.files("rolledger.workers.operator").joinpath("ui_page.html").read_text(encoding="utf-8")


_USERINFO = re.compile(r"(//[^/@:\s]*):[^@/\s]*@")


def _redacted(obj: Any) -> Any:
    """Every string with every `//user:secret@` userinfo masked (events.redact's rule, applied inside free text);
    a NaN or infinite number becomes null (JSON has none)."""
    if isinstance(obj, str):
        return _USERINFO.sub(rf"\1:{MASK}@", obj) if "@" in obj else obj
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _redacted(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redacted(v) for v in obj]
    return obj


class _Handler(BaseHTTPRequestHandler):
    server: UiServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the page polls every second: no access log

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, data: Any, status: HTTPStatus = HTTPStatus.OK) -> None:
        self._send(status, json.dumps(_redacted(data), allow_nan=False, default=str).encode(), "application/json")

    def _presented(self) -> tuple[str | None, str | None]:
        """(the token of the Authorization header or cookie, the token of a `?token=` query), None where absent."""
        header = self.headers.get("Authorization", "")
        scheme, _, value = header.partition(" ")
        carried: str | None = value.strip() if scheme.lower() == "bearer" else None
        if carried is None and self.headers.get("Cookie"):
            try:
                jar = SimpleCookie(self.headers["Cookie"])
            except CookieError:
                jar = SimpleCookie()
            if TOKEN_COOKIE in jar:
                carried = jar[TOKEN_COOKIE].value
        query = parse_qs(urlsplit(self.path).query).get("token")
        return carried, query[-1] if query else None

    def _authorized(self) -> bool:
        """Is the request let through? Without a token, yes. A right `?token=` is answered here: a redirect to the
        same address without it, setting the cookie the page's fetches carry from then on."""
        token = self.server.token
        if token is None:
            return True
        carried, queried = self._presented()
        if queried is not None and self.server.token_matches(queried):
            url = urlsplit(self.path)
            rest = [(k, v) for k, vs in parse_qs(url.query, keep_blank_values=True).items() if k != "token" for v in vs]
            self.send_response(HTTPStatus.SEE_OTHER)
            self.send_header("Location", urlunsplit(("", "", url.path, urlencode(rest), "")))
            self.send_header(
                "Set-Cookie", f"{TOKEN_COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict; Max-Age=2592000"
            )
            self.send_header("Content-Length", "0")
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            return False
        if carried is not None and self.server.token_matches(carried):
            return True
        self.send_response(HTTPStatus.UNAUTHORIZED)
        body = json.dumps({"error": "a token is required: Authorization: Bearer TOKEN, or open ?token=TOKEN"}).encode()
        self.send_header("WWW-Authenticate", 'Bearer realm="rolledger ui"')
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)
        return False

    def do_GET(self) -> None:
        if not self.server.host_allowed(self.headers.get("Host", "")):
            self._json({"error": "host not allowed"}, HTTPStatus.FORBIDDEN)
            return
        if not self._authorized():
            return
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        query.pop("token", None)
        try:
            if url.path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, self.server.page.encode(), "text/html; charset=utf-8")
            elif url.path == "/api/view":
                self._json(self.server.api_view(query))
            elif url.path == "/api/events":
                self._json(self.server.api_events(query))
            elif url.path == "/api/lineage":
                self._json(self.server.api_lineage(query))
            else:
                self._json({"error": f"no such page: {url.path}"}, HTTPStatus.NOT_FOUND)
        except KeyError as exc:
            self._json({"error": str(exc.args[0] if exc.args else exc)}, HTTPStatus.NOT_FOUND)
        except ValueError as exc:
            self._json({"error": str(exc)}, HTTPStatus.BAD_REQUEST)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the page went away mid-answer
        except Exception as exc:  # noqa: BLE001 - the log unreachable (Redis down past its deadline), ...: the page says so
            log.warning("ui request failed", path=url.path, error=redact(str(exc)))
            self._json({"error": f"cannot read the log: {redact(str(exc))}"}, HTTPStatus.SERVICE_UNAVAILABLE)


class UiServer(ThreadingHTTPServer):
    """The HTTP server of one run's page."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, live: LiveLog, host: str, port: int, allow_remote: bool = False, token: str | None = None
    ) -> None:
        self.live = live
        self.allow_remote = allow_remote
        self.token = token  # every request must carry it (see the module docstring); None: none is asked
        self.page = page_html()
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = str(self.server_address[0]), int(self.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"

    def token_matches(self, given: str) -> bool:
        assert self.token is not None
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self.token.encode())

    def host_allowed(self, header: str) -> bool:
        if self.allow_remote:
            return True
        name = header.rsplit(":", 1)[0] if not header.endswith("]") else header
        name = name.strip("[]").lower()
        if name == "localhost":
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False

    def api_view(self, query: dict[str, list[str]]) -> dict[str, Any]:
        self.live.refresh()
        with self.live.lock:
            view = self.live.view
            if query.get("since", [None])[-1] == view.cursor:
                return {"cursor": view.cursor, "unchanged": True}
            return {
                "cursor": view.cursor,
                "status": view.status(),
                "timeline": view.timeline(),
                "curves": view.curves(),
            }

    def api_events(self, query: dict[str, list[str]]) -> dict[str, Any]:
        flt = parse_filter(query)
        raw_limit = query.get("limit", ["500"])[-1]
        try:
            limit = max(0, min(int(raw_limit), 5000))
        except ValueError:
            raise ValueError(f"limit must be an integer, not {raw_limit!r}") from None
        self.live.refresh()
        with self.live.lock:
            return {"cursor": self.live.view.cursor, **self.live.view.events_page(flt, limit)}

    def api_lineage(self, query: dict[str, list[str]]) -> dict[str, Any]:
        ref = (query.get("id") or query.get("trajectory") or query.get("group") or [""])[-1].strip()
        if not ref:
            raise ValueError("give id=TRAJECTORY_ID or a group id")
        self.live.refresh()
        with self.live.lock:
            return self.live.view.lineage(ref)


def bind_host(host: str, allow_remote: bool) -> str:
    """The address to bind for --host: every address it names must be loopback unless `allow_remote`."""
    try:
        addresses = [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except socket.gaierror as exc:
            raise UiRefused(f"--host {host!r} cannot be resolved: {exc}") from None
        addresses = list(dict.fromkeys(ipaddress.ip_address(str(i[4][0]).split("%", 1)[0]) for i in infos))
    if not addresses:
        raise UiRefused(f"--host {host!r} resolved to no address")

    def loopback(a: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
            a = a.ipv4_mapped
        return a.is_loopback

    outside = [str(a) for a in addresses if not loopback(a)]
    if outside and not allow_remote:
        raise UiRefused(
            f"--host {host!r} is {', '.join(outside)}, not loopback: the page shows the whole run; give "
            "--allow-remote to serve it there, behind a token (see 'rolledger ui --help')"
        )
    ipv4 = [a for a in addresses if a.version == 4]
    return str(ipv4[0] if ipv4 else addresses[0])


def serve(
    client: redis.Redis,
    run_id: str,
    host: str,
    port: int,
    scan: Scan,
    allow_remote: bool = False,
    reopen: Callable[[], redis.Redis] | None = None,
    token: str | None = None,
) -> UiServer:
    """Bind the page's server over an opened run (an OSError if the port is busy) and return it; the caller runs
    `serve_forever` and closes it."""
    live = LiveLog(client, run_id, scan, reopen)
    live.refresh()
    return UiServer(live, host, port, allow_remote=allow_remote, token=token)


class _Terminated(Exception):
    """SIGTERM while serving."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


def run_ui(
    host: str,
    port: int,
    allow_remote: bool,
    opened: Callable[[], AbstractContextManager[tuple[redis.Redis, str]]],
    scan: Scan,
    token_file: str | None = None,
) -> int:
    """`rolledger ui`: check the host and the token, open the run, print the URL as one line (with a generated
    token in it) and serve until Ctrl-C (exit 130) or SIGTERM (143). A refused host, token or a busy port is a
    UiRefused."""
    address = bind_host(host, allow_remote)
    token = ui_token(allow_remote, token_file)
    try:
        with ExitStack() as stack:
            client, run_id = stack.enter_context(opened())

            def reopen() -> redis.Redis:  # the run's own Redis stopped with the run: open it again (its AOF)
                return stack.enter_context(opened())[0]

            try:
                server = serve(
                    client,
                    run_id,
                    address,
                    port,
                    scan,
                    allow_remote=allow_remote,
                    reopen=reopen,
                    token=token.value if token else None,
                )
            except OSError as exc:
                raise UiRefused(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, _terminate)
                # Ctrl-C stops it even where SIGINT was inherited ignored (a background job of a non-interactive
                # shell, as CI runs it): Python installs its KeyboardInterrupt handler only over the default
                signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                if token is None:
                    shown, note = server.url, ""
                elif token.source == "generated":  # printed once, here: the only place it exists
                    shown, note = f"{server.url}?token={token.value}", "; token generated for this start"
                else:
                    where = "--token-file" if token.source == "file" else f"${TOKEN_ENV}"
                    shown, note = server.url, f"; requests need the token of {where}"
                print(f"{shown}  (run {run_id}{note}; Ctrl-C stops)", flush=True)
                server.serve_forever(poll_interval=0.5)
            finally:
                server.server_close()
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except _Terminated:
        return 143
    return 0
