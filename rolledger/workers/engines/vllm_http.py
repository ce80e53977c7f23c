"""The HTTP connection to one inference server (vLLM or SGLang), and the parsing of its errors.

The servers answer errors in several shapes (`{"error": "..."}` from vLLM's RL routes, `{"error": {"message": ...}}`
from the OpenAI routes, `{"message": ...}` or `{"success": false, ...}` from SGLang, a list of details from FastAPI
validation); `JsonHttp` turns every failure (no answer, a transport error, a non-200 status, a body that is not a
JSON object) into an EngineError naming the server kind, the route and the server. `VllmHttp` adds `rpc`, which calls
`/collective_rpc` on every worker of a vLLM server (the routes of
`rolledger.workers.weights.vllm_extension.RolledgerWorkerExtension`, which answer one dict per worker and never raise).

Threads: one `JsonHttp` serves a rank's control thread and all its rollout slots at once. Its `httpx.Client` is
thread-safe (a connection pool under a lock); each request takes a connection of its own from the pool, so requests
of several slots are in flight together (no lock around a request), and the pool is unbounded so no slot waits for
another's connection (the connections open are at most the requests in flight: the rank's slots, at most 256, and
its control thread).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx

from rolledger.workers.engines.protocol import EngineError

DEFAULT_EXTENSION = "rolledger.workers.weights.vllm_extension.RolledgerWorkerExtension"
_POOL = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # one per request in flight (above)


class HttpRouteError(EngineError):
    """A server's route answered with an error; carries the HTTP status and the server's message."""

    def __init__(self, route: str, base_url: str, status: int, message: str, *, server: str = "vLLM") -> None:
        super().__init__(f"{server} {route} at {base_url} failed: HTTP {status}: {message}")
        self.route = route
        self.status = status
        self.message = message


VllmHttpError = HttpRouteError  # the name vLLM callers know


def error_message(resp: httpx.Response) -> str:
    """The server's message from any of the error shapes above (or the raw body)."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:500] or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body.get("detail"))
        if isinstance(err, str):
            return err
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, list):  # FastAPI validation details
            return json.dumps(err)[:500]
        if isinstance(body.get("message"), str):  # SGLang
            return str(body["message"])
    return json.dumps(body)[:500]


class JsonHttp:
    """JSON requests to the `server` (a kind: "vLLM", "SGLang") at `base_url`; every failure is an EngineError
    (HttpRouteError for a status)."""

    server = "server"

    def __init__(self, base_url: str, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout_s, limits=_POOL)

    def request(self, method: str, route: str, **kw: Any) -> httpx.Response:
        try:
            resp = self._client.request(method, route, **kw)
        except httpx.TimeoutException as e:
            raise EngineError(f"{self.server} {route} at {self.base_url}: no answer within {self.timeout_s}s") from e
        except httpx.HTTPError as e:
            raise EngineError(f"{self.server} {route} at {self.base_url}: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            raise HttpRouteError(route, self.base_url, resp.status_code, error_message(resp), server=self.server)
        return resp

    def request_json(self, method: str, route: str, **kw: Any) -> dict[str, Any]:
        resp = self.request(method, route, **kw)
        if not resp.content:
            return {}
        body = resp.json()
        if not isinstance(body, dict):
            raise EngineError(f"{self.server} {route} at {self.base_url}: expected a JSON object, got {body!r:.200}")
        return body

    def get(self, route: str, **kw: Any) -> dict[str, Any]:
        return self.request_json("GET", route, **kw)

    @contextlib.contextmanager
    def stream_events(self, route: str, body: dict[str, Any]) -> Iterator[Iterator[dict[str, Any]]]:
        """POST `body` (with "stream": true) and yield its server-sent events, each `data:` line's JSON object, up to
        `[DONE]`. Leaving the block early closes the connection: the server sees the client go and aborts the request
        (what a first-k group's cancelled samples need). Every failure is an EngineError, as for `request`."""
        try:
            with self._client.stream("POST", route, json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise HttpRouteError(
                        route, self.base_url, resp.status_code, error_message(resp), server=self.server
                    )
                yield _sse_objects(resp.iter_lines(), f"{self.server} {route} at {self.base_url}")
        except httpx.TimeoutException as e:
            raise EngineError(f"{self.server} {route} at {self.base_url}: no answer within {self.timeout_s}s") from e
        except httpx.HTTPError as e:
            raise EngineError(f"{self.server} {route} at {self.base_url}: {type(e).__name__}: {e}") from e

    def post(self, route: str, **kw: Any) -> dict[str, Any]:
        return self.request_json("POST", route, **kw)

    def close(self) -> None:
        self._client.close()


def _sse_objects(lines: Iterator[str], where: str) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            return
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise EngineError(f"{where}: expected a JSON object per event, got {obj!r:.200}")
        if "error" in obj and "choices" not in obj:
            raise EngineError(f"{where}: the stream failed: {obj['error']!r:.300}")
        yield obj


class VllmHttp(JsonHttp):
    """A vLLM server's JSON routes, and collective_rpc on its workers."""

    server = "vLLM"

    def rpc(self, method: str, *args: Any, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """collective_rpc on every worker; one dict per worker (the extension never raises, it answers ok:false)."""
        body: dict[str, Any] = {"method": method, "args": list(args)}
        if timeout_s is not None:
            body["timeout"] = timeout_s
        results = self.post("/collective_rpc", json=body, timeout=timeout_s or self.timeout_s).get("results")
        if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
            raise EngineError(
                f"vLLM collective_rpc {method} at {self.base_url}: expected one dict per worker, got {results!r:.300}; "
                f"is the server started with --worker-extension-cls {DEFAULT_EXTENSION}?"
            )
        return results
