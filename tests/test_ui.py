"""`rolledger ui RUN`: the JSON the page polls (from the committed fixture logs, XADDed into the test redis), the
server's reads (incremental, read-only), its refusals (a non-loopback host, a foreign Host header, a busy port),
Ctrl-C, and the page itself in a real headless Chromium: lanes, curves, the aborted update, a lineage click, and a
running run that the open page then shows finished.

The browser tests skip, with the reason printed, only where no Chromium is installed (`.ci/run` installs Debian's).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from cdp import Browser, Page, find_chromium

from rolledger.events.codec import decode
from rolledger.events.keys import log_key
from rolledger.events.scan import LogScan, scan_log
from rolledger.events.store import PAYLOAD_FIELD, TYPE_FIELD
from rolledger.schemas import events as ev
from rolledger.workers.operator.cli import main
from rolledger.workers.operator.ui_server import LiveLog, UiRefused, UiServer, bind_host, page_html, serve
from rolledger.workflows.ui_view import EventFilter, parse_filter, view_of

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
from history import load_entries


# ---------------------------------------------------------------- helpers
def fixture_events(name: str) -> list[tuple[str, ev.Event]]:
    _run_id, entries = load_entries(name)
    return [(sid, decode(raw)) for sid, raw in entries]


def xadd(client: redis.Redis, run_id: str, entries: list[tuple[str, bytes]]) -> None:
    for sid, raw in entries:
        client.xadd(log_key(run_id), {PAYLOAD_FIELD: raw, TYPE_FIELD: decode(raw).type}, id=sid)


def load(client: redis.Redis, run_id: str, name: str, upto: int | None = None) -> list[tuple[str, bytes]]:
    """XADD the fixture's first `upto` entries (all by default) into `run_id`'s log; the rest is returned."""
    _fixture_run, entries = load_entries(name)
    cut = len(entries) if upto is None else upto
    xadd(client, run_id, entries[:cut])
    return entries[cut:]


def train_steps(name: str) -> list[ev.TrainStepFinished]:
    return [e.payload for _, e in fixture_events(name) if isinstance(e.payload, ev.TrainStepFinished)]


class Served:
    """A UI server over a run, on a free loopback port, in a thread; `get` fetches JSON from it."""

    def __init__(self, client: redis.Redis, run_id: str, scan: Callable[[redis.Redis, str, str], LogScan]) -> None:
        self.server: UiServer = serve(client, run_id, "127.0.0.1", 0, scan)
        self.thread = threading.Thread(target=self.server.serve_forever, name="ui-test", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return self.server.url

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        req = urllib.request.Request(self.url + path.lstrip("/"), headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                body = resp.read()
                ctype = resp.headers.get("Content-Type", "")
                return resp.status, json.loads(body) if "json" in ctype else body.decode()
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def served(redis_client: redis.Redis, run_id: str) -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(scan: Callable[[redis.Redis, str, str], LogScan] = scan_log) -> Served:
        s = Served(redis_client, run_id, scan)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


# ---------------------------------------------------------------- the view, pure
def test_the_view_of_a_finished_run_has_its_status_lanes_and_curves() -> None:
    view = view_of(fixture_events("clean"))
    st = view.status()
    steps = train_steps("clean")
    assert st["status"] == "completed" and st["finished"] and st["step"] == st["steps"] == 3
    assert st["published"] == 3 and st["aborted"] == 0 and st["events"] == 188
    assert st["reward_last"] == steps[-1].reward_mean and st["reward_first"] == steps[0].reward_mean
    assert [p["reward"] for p in view.curves()["steps"]] == [s.reward_mean for s in steps]
    tl = view.timeline()
    assert {"rank 0", "rank 1", "trainer", "updates"} <= set(tl["rows"])
    generate = [s for s in tl["spans"] if s["kind"] == "generate"]
    assert sorted(s["group"] for s in generate) == [f"g{i:06d}" for i in range(8)]
    consumed = sum(
        len(e.payload.group_ids) for _, e in fixture_events("clean") if isinstance(e.payload, ev.BatchConsumed)
    )
    assert sum(n for _lag, n in tl["lag_histogram"]) == consumed


def test_the_abort_shows_as_an_aborted_update_with_its_reason_and_rank() -> None:
    view = view_of(fixture_events("abort"))
    (aborted,) = [u for u in view.status()["updates"] if u["status"] == "aborted"]
    assert aborted["version"] == 1 and aborted["failed_ranks"] == [1] and "fail-rank=1@transfer" in aborted["reason"]
    assert any(s["kind"] == "abort" and s["label"].startswith("v1 aborted") for s in view.timeline()["spans"])


def test_event_filters_by_type_group_rank_and_version() -> None:
    view = view_of(fixture_events("abort"))
    page = view.events_page(EventFilter(types=frozenset({"UpdateAborted"})))
    assert page["matched"] == 1 and page["rows"][0]["ranks"] == [1] and page["rows"][0]["version"] == 1
    group = view.events_page(EventFilter(group="g000003"))["rows"]
    assert {r["type"] for r in group} >= {"GroupAdmitted", "SampleStarted", "SampleFinished", "GroupCompleted"}
    assert all("g000003" in r["groups"] for r in group)
    started = [r for r in group if r["type"] == "SampleStarted"]
    assert sorted(t for r in started for t in r["trajectories"]) == [f"g000003/{i}" for i in range(4)]
    rank1 = view.events_page(EventFilter(rank=1))["rows"]
    assert rank1 and all(1 in r["ranks"] for r in rank1)
    v2 = view.events_page(EventFilter(types=frozenset({"PolicyPublished"}), version=2))["rows"]
    assert [r["version"] for r in v2] == [2]
    limited = view.events_page(EventFilter(), limit=10)
    assert limited["matched"] == 171 and [r["i"] for r in limited["rows"]] == list(range(161, 171))
    assert parse_filter({"type": ["A,B", "C"], "rank": ["2"], "version": ["v3"], "group": [" "]}) == EventFilter(
        frozenset({"A", "B", "C"}), None, 2, 3
    )
    with pytest.raises(ValueError, match="rank must be an integer"):
        parse_filter({"rank": ["one"]})


def test_lineage_of_a_trajectory_or_of_a_group() -> None:
    view = view_of(fixture_events("clean"))
    one = view.lineage("g000002/1")
    assert one["trajectory_id"] == "g000002/1" and one["group_id"] == "g000002"
    assert one["siblings"] == [f"g000002/{i}" for i in range(4)]
    assert one["lineage"]["sample"]["sample_id"] == "g000002/1" and "trajectory g000002/1" in one["text"]
    assert view.lineage("g000002")["trajectory_id"] == "g000002/0"
    with pytest.raises(KeyError, match="nope"):
        view.lineage("nope")


# ---------------------------------------------------------------- the server, over HTTP
def test_the_endpoints_answer_from_the_log_and_write_nothing(
    redis_client: redis.Redis, run_id: str, served: Callable[..., Served]
) -> None:
    load(redis_client, run_id, "abort")
    keys_before = sorted(redis_client.keys(f"*{run_id}*"))
    length_before = redis_client.xlen(log_key(run_id))
    s = served()
    code, page = s.get("/")
    assert code == 200 and page == page_html() and "<script>" in page
    code, view = s.get("/api/view")
    assert code == 200 and view["status"]["status"] == "completed" and view["status"]["aborted"] == 1
    assert view["cursor"] == "171" and len(view["curves"]["steps"]) == 3
    assert s.get(f"/api/view?since={view['cursor']}") == (200, {"cursor": "171", "unchanged": True})
    code, events = s.get("/api/events?type=UpdateAborted,RankPrepareFailed")
    assert code == 200 and [r["type"] for r in events["rows"]] == ["RankPrepareFailed", "UpdateAborted"]
    code, chain = s.get("/api/lineage?id=g000003/2")
    assert code == 200 and chain["lineage"]["trajectory_id"] == "g000003/2"
    code, missing = s.get("/api/lineage?id=g999999/0")
    assert code == 404 and "g999999/0" in missing["error"]
    assert s.get("/api/events?version=x")[0] == 400
    assert s.get("/api/nothing")[0] == 404
    assert sorted(redis_client.keys(f"*{run_id}*")) == keys_before
    assert redis_client.xlen(log_key(run_id)) == length_before


def test_a_request_naming_another_host_is_refused(
    redis_client: redis.Redis, run_id: str, served: Callable[..., Served]
) -> None:
    load(redis_client, run_id, "clean")
    s = served()
    assert s.get("/api/view", {"Host": "evil.example:80"})[0] == 403  # a DNS-rebinding page
    assert s.get("/api/view", {"Host": "localhost:1"})[0] == 200
    assert s.get("/api/view", {"Host": "[::1]:1"})[0] == 200


def test_a_live_run_is_read_incrementally_from_the_last_stream_id(
    redis_client: redis.Redis, run_id: str, served: Callable[..., Served]
) -> None:
    rest = load(redis_client, run_id, "clean", upto=100)
    starts: list[str] = []

    def recording_scan(client: redis.Redis, rid: str, start: str) -> LogScan:
        starts.append(start)
        return scan_log(client, rid, start)

    s = served(recording_scan)
    _, first = s.get("/api/view")
    assert first["status"]["status"] == "running" and first["status"]["events"] == 100
    xadd(redis_client, run_id, rest)
    _, second = s.get("/api/view?since=" + first["cursor"])
    assert second["status"]["status"] == "completed" and second["status"]["events"] == 188
    _, fixture_entries = load_entries("clean")
    assert starts[0] == "-" and "(" + fixture_entries[99][0] in starts  # then only what came after entry 100
    n = len(starts)
    s.get("/api/view")
    assert len(starts) == n  # a finished run is not read again


def test_live_log_reports_undecodable_entries_without_dead_lettering(redis_client: redis.Redis, run_id: str) -> None:
    load(redis_client, run_id, "clean", upto=20)
    redis_client.xadd(log_key(run_id), {PAYLOAD_FIELD: b"\xc1junk", TYPE_FIELD: "SampleScored"})
    live = LiveLog(redis_client, run_id, scan_log)
    live.refresh()
    assert live.view.undecodable == 1 and len(live.view.events) == 20 and live.view.cursor == "21"
    live.refresh()
    assert live.view.cursor == "21"  # nothing read twice
    assert not redis_client.keys(f"*{run_id}*dead*")


# ---------------------------------------------------------------- the command
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_hosts_are_served(host: str) -> None:
    assert bind_host(host, allow_remote=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "8.8.8.8", "::"])
def test_other_hosts_are_refused_unless_allowed(host: str) -> None:
    with pytest.raises(UiRefused, match="--allow-remote"):
        bind_host(host, allow_remote=False)
    assert bind_host(host, allow_remote=True) == host


def test_the_command_refuses_in_one_line(
    redis_url: str, run_id: str, redis_client: redis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ui", "nonexistent-run", "--runs-dir", str(tmp_path)]) == 2
    assert main(["ui", run_id, "--redis", redis_url, "--host", "0.0.0.0"]) == 2
    load(redis_client, run_id, "clean", upto=5)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["ui", run_id, "--redis", redis_url, "--port", str(busy.getsockname()[1])]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(line.startswith("rolledger ui: ") for line in lines), lines
    assert "nonexistent-run" in lines[0] and "0.0.0.0" in lines[1] and "cannot serve" in lines[2]


def test_ctrl_c_stops_it_cleanly(redis_url: str, run_id: str, redis_client: redis.Redis) -> None:
    load(redis_client, run_id, "clean")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rolledger.workers.operator.cli", "ui", run_id, "--redis", redis_url, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the URL, as one line, once it serves
        url = line.split()[0]
        assert url.startswith("http://127.0.0.1:") and run_id in line
        with urllib.request.urlopen(url + "api/view", timeout=30) as resp:
            assert json.loads(resp.read())["status"]["status"] == "completed"
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err


# ---------------------------------------------------------------- the page, in a real browser
@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    binary = find_chromium()
    if binary is None:
        pytest.skip(
            "no Chromium found (apt-get install chromium, or set ROLLEDGER_CHROMIUM); the page is untested here"
        )
    b = Browser(binary, tmp_path_factory.mktemp("chromium") / "profile")
    yield b
    b.close()


@pytest.fixture
def open_page(browser: Browser) -> Iterator[Callable[[str], Page]]:
    pages: list[Page] = []

    def open_(url: str) -> Page:
        page = browser.page(url)
        pages.append(page)
        return page

    yield open_
    for p in pages:
        p.close()
    errors, browser.errors[:] = list(browser.errors), []
    assert not errors, errors  # no uncaught exception, no console.error in the page


def test_the_page_shows_lanes_curves_and_a_clicked_lineage(
    redis_client: redis.Redis, run_id: str, served: Callable[..., Served], open_page: Callable[[str], Page]
) -> None:
    load(redis_client, run_id, "clean")
    page = open_page(served().url)
    page.wait_for("document.querySelector('#status').dataset.status === 'completed'")
    page.wait_for("document.querySelectorAll('#events tbody tr').length === 188")
    lanes = page.evaluate(
        "Object.fromEntries([...document.querySelectorAll('#timeline g.lane')].map(g => [g.dataset.row,"
        " [...g.querySelectorAll('rect.span.generate')].map(r => r.dataset.group)]))"
    )
    assert {"rank 0", "rank 1", "trainer", "updates"} <= set(lanes)
    assert lanes["rank 0"] and lanes["rank 1"]  # both ranks generated
    assert sorted(lanes["rank 0"] + lanes["rank 1"]) == [f"g{i:06d}" for i in range(8)]
    points = page.evaluate("[...document.querySelectorAll('#reward-chart circle.pt')].map(c => +c.dataset.y)")
    assert points == [s.reward_mean for s in train_steps("clean")]
    assert page.evaluate("document.querySelectorAll('#timeline rect.span.commit').length") == 3
    assert page.evaluate("document.querySelectorAll('#lag-chart rect.bar').length") >= 1
    assert page.evaluate("document.querySelectorAll('#queue-chart path.line').length") == 1

    page.click("#timeline rect.span.generate[data-group='g000003']")  # a group in the lanes: its first trajectory
    page.wait_for("document.querySelector('#lineage').dataset.id === 'g000003/0'")
    text = page.evaluate("document.querySelector('#lineage-text').textContent")
    assert text.startswith("trajectory g000003/0 (run fx-clean)") and "consumed by trainer at trainer step" in text
    assert page.evaluate("document.querySelectorAll('#timeline rect.span.selected').length") == 1

    page.click("#events a.traj[data-id='g000005/2']")  # a trajectory in the event list
    page.wait_for("document.querySelector('#lineage').dataset.id === 'g000005/2'")
    assert page.evaluate("location.hash") == "#lineage=g000005/2"
    assert "trajectory g000005/2" in page.evaluate("document.querySelector('#lineage-text').textContent")


def test_the_page_shows_the_aborted_update_and_honours_a_lineage_link(
    redis_client: redis.Redis, run_id: str, served: Callable[..., Served], open_page: Callable[[str], Page]
) -> None:
    load(redis_client, run_id, "abort")
    page = open_page(served().url + "#lineage=g000002/1&type=UpdateAborted")
    page.wait_for("document.querySelector('#lineage').dataset.id === 'g000002/1'")
    page.wait_for("document.querySelectorAll('#events tbody tr').length === 1")
    assert page.evaluate("document.querySelector('#events tbody tr').dataset.type") == "UpdateAborted"
    aborted = page.evaluate(
        "[...document.querySelectorAll('#timeline rect.span.abort')].map(r => r.querySelector('title').textContent)"
    )
    assert len(aborted) == 1 and aborted[0].startswith("v1 aborted (rank 1, transfer): rank 1: transfer")
    outcomes = page.evaluate(
        "[...document.querySelectorAll('#updates tbody tr')].map(r => [+r.dataset.version, r.dataset.outcome])"
    )
    assert outcomes == [[1, "aborted"], [2, "published"], [3, "published"]]
    assert "✗" in page.evaluate("document.querySelector('#timeline text.mark.abort').textContent")


def test_the_page_follows_a_running_run_until_it_finishes(
    redis_client: redis.Redis, run_id: str, served: Callable[..., Served], open_page: Callable[[str], Page]
) -> None:
    _, entries = load_entries("clean")
    steps_at = [i for i, (_, raw) in enumerate(entries) if decode(raw).type == "TrainStepFinished"]
    rest = load(redis_client, run_id, "clean", upto=steps_at[1])  # one trainer step in, no RunFinished
    s = served()
    page = open_page(s.url)
    page.wait_for("document.querySelector('#status').dataset.status === 'running'")
    page.wait_for("document.querySelectorAll('#reward-chart circle.pt').length === 1")
    assert page.evaluate("document.querySelector('#cards [data-k=step] .v').textContent") == "1 / 3"
    xadd(redis_client, run_id, rest)  # the run goes on: the open page polls and shows it
    page.wait_for("document.querySelector('#status').dataset.status === 'completed'")
    page.wait_for("document.querySelectorAll('#reward-chart circle.pt').length === 3")
    assert s.get("/api/view")[1]["status"]["finished"] is True


def test_a_live_run_whose_redis_went_away_is_read_again_through_a_reopened_client(
    redis_client: redis.Redis, run_id: str
) -> None:
    rest = load(redis_client, run_id, "clean", upto=50)
    gone = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=1)  # nothing listens there
    live = LiveLog(redis_client, run_id, scan_log, reopen=lambda: redis_client)
    live.refresh()
    xadd(redis_client, run_id, rest)
    live.client = gone  # the run ended and its embedded server stopped; reopening finds its AOF (here: the same log)
    live.refresh()
    assert live.client is redis_client and live.view.status()["status"] == "completed"
    assert live.view.cursor == "188"
    without = LiveLog(gone, run_id, scan_log)
    with pytest.raises(redis.ConnectionError):
        without.refresh()


def test_answers_mask_passwords_and_carry_no_nan() -> None:
    from rolledger.workers.operator.ui_server import _redacted

    data = {"a": ["uri redis://u:hunter2@h:6379/0 x", float("nan")], "b": 1.5, "c": "plain@text"}
    assert _redacted(data) == {"a": ["uri redis://u:***@h:6379/0 x", None], "b": 1.5, "c": "plain@text"}
