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
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import redis
import structlog

from rolledger.events.redact import MASK, redact
from rolledger.workflows.replay import position
from rolledger.workflows.ui_view import RunView, parse_filter

if TYPE_CHECKING:
    from rolledger.events.scan import LogScan

log = structlog.get_logger("rolledger.ui")

Scan = Callable[["redis.Redis", str, str], "LogScan"]


class UiRefused(ValueError):
    """The page cannot be served as asked: a --host that is not loopback (without allow_remote) or does not
    resolve, a busy port. One line, for the command line to print."""


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
    return resources.files("rolledger.workers").joinpath("ui_page.html").read_text(encoding="utf-8")


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

    def do_GET(self) -> None:
        if not self.server.host_allowed(self.headers.get("Host", "")):
            self._json({"error": "host not allowed"}, HTTPStatus.FORBIDDEN)
            return
        url = urlsplit(self.path)
        query = parse_qs(url.query)
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

    def __init__(self, live: LiveLog, host: str, port: int, allow_remote: bool = False) -> None:
        self.live = live
        self.allow_remote = allow_remote
        self.page = page_html()
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = str(self.server_address[0]), int(self.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"

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
            f"--host {host!r} is {', '.join(outside)}, not loopback: the page has no authentication and shows the "
            "whole run; give --allow-remote to serve it there anyway"
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
) -> UiServer:
    """Bind the page's server over an opened run (an OSError if the port is busy) and return it; the caller runs
    `serve_forever` and closes it."""
    live = LiveLog(client, run_id, scan, reopen)
    live.refresh()
    return UiServer(live, host, port, allow_remote=allow_remote)


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
) -> int:
    """`rolledger ui`: check the host, open the run, print the URL as one line and serve until Ctrl-C (exit 130)
    or SIGTERM (143). A refused host or a busy port is a UiRefused."""
    address = bind_host(host, allow_remote)
    try:
        with ExitStack() as stack:
            client, run_id = stack.enter_context(opened())

            def reopen() -> redis.Redis:  # the run's own Redis stopped with the run: open it again (its AOF)
                return stack.enter_context(opened())[0]

            try:
                server = serve(client, run_id, address, port, scan, allow_remote=allow_remote, reopen=reopen)
            except OSError as exc:
                raise UiRefused(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, _terminate)
                # Ctrl-C stops it even where SIGINT was inherited ignored (a background job of a non-interactive
                # shell, as CI runs it): Python installs its KeyboardInterrupt handler only over the default
                signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                print(f"{server.url}  (run {run_id}; Ctrl-C stops)", flush=True)
                server.serve_forever(poll_interval=0.5)
            finally:
                server.server_close()
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except _Terminated:
        return 143
    return 0
