"""Open a run's log for reading, given a run id or a run directory (DESIGN: `RUN` is either).

Order: an explicit --redis URL or REDIS_URL; else the run directory's live embedded server (its `redis_url` file,
if something answers there; a redis+cluster:// URL there is used as it is: that run's log is in the cluster); else start an embedded server over the directory's AOF (a finished run), and stop it
when done. The `redis_url` file holds the URL with its password redacted (events/redact.py); the password comes
from REDIS_PASSWORD when the URL needs one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from rolledger.events.connection import connect, is_cluster_url
from rolledger.events.embedded import EmbeddedRedis
from rolledger.events.redact import MASK, with_password


class NoSuchRun(LookupError):
    """The reference names no run directory and no Redis was given to look the run up in."""


@dataclass(frozen=True)
class RunRef:
    run_id: str
    run_dir: Path | None


def resolve(ref: str, runs_dir: Path = Path("runs")) -> RunRef:
    p = Path(ref)
    if p.is_dir() and ((p / "redis_url").exists() or any(p.glob("appendonly*"))):
        return RunRef(p.resolve().name, p.resolve())
    candidate = runs_dir / ref
    if candidate.is_dir():
        return RunRef(ref, candidate.resolve())
    return RunRef(p.name if p.is_dir() else ref, None)


@contextmanager
def open_run(
    ref: str, redis_url: str | None = None, runs_dir: Path = Path("runs")
) -> Iterator[tuple[redis.Redis, str]]:
    run = resolve(ref, runs_dir)
    url = redis_url or os.environ.get("REDIS_URL")
    if url:
        client = connect(url)
        try:
            yield client, run.run_id
        finally:
            client.close()
        return
    if run.run_dir is None:
        raise NoSuchRun(
            f"no run {ref!r}: no run directory {(runs_dir / ref).absolute()} and no --redis/REDIS_URL to look it up in"
        )
    live = _live_url(run.run_dir)
    if live is not None:
        client = connect(live)
        try:
            yield client, run.run_id
        finally:
            client.close()
        return
    embedded = EmbeddedRedis(run.run_dir)
    client = connect(embedded.start())
    try:
        yield client, run.run_id
    finally:
        client.close()
        embedded.stop()


def _live_url(run_dir: Path) -> str | None:
    f = run_dir / "redis_url"
    if not f.exists():
        return None
    url = f.read_text().strip()
    if MASK in url:
        password = os.environ.get("REDIS_PASSWORD")
        if not password:
            return None
        url = with_password(url, password)
    if url.startswith("unix://") and not Path(url.removeprefix("unix://").split("?")[0]).exists():
        return None  # the server of a finished run: its socket went with it
    if is_cluster_url(url):  # a cluster run's log lives in the cluster, never in the run directory's AOF: no fallback
        return url
    try:  # one probe, no outage retry: a finished run's socket file outlives its server, and riding out an
        # "outage" there would cost the retry deadline (a minute) before the AOF is opened
        probe = redis.Redis.from_url(url, socket_connect_timeout=2.0, socket_timeout=2.0)
        try:
            probe.ping()
        finally:
            probe.close()
        return url
    except (redis.ConnectionError, redis.TimeoutError, OSError, ValueError):
        return None
