"""`rolledger events RUN`: the run's log as a person reads it, one line per event (the CLI edge of
workflows/event_lines.py, which formats and filters).

Read-only: the log is read with XRANGE (`_scan`) and, with `--follow`, a blocking XREAD from the last entry shown;
nothing is written into the run's Redis (an undecodable entry is shown as a line saying so, not dead-lettered).

`--since`/`--until` bound the lines shown (both inclusive), each one of:
- a stream id (`1796155965864-0`, or just its milliseconds `1796155965864`): the entries from/up to it;
- an event id (a 26-character ULID): the entries from/up to that event's entry (it must be in the log);
- an ISO-8601 time (`2026-12-02T14:39:42.5Z`; no zone means UTC): the events written from/up to then.
The whole log is still read from its start, so an abort's line names the phase its earlier RankPrepareFailed gave.

`--follow`: after the lines so far, keep reading new entries as they are appended (blocking XREAD, at most
`FOLLOW_BLOCK_MS` per call) until `RunFinished` has been read, an entry past `--until` arrives, nothing new came for
`--idle-timeout` seconds (a note on stderr; exit 0), or Ctrl-C (exit 130, nothing printed).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from rolledger.workers.operator.cli_errors import CliError
from rolledger.workers.operator.cli_read import _open, _scan

if TYPE_CHECKING:
    import redis

    from rolledger.events.scan import Undecodable
    from rolledger.events.store import StoredEvent
    from rolledger.workflows.event_lines import EventFilter

FOLLOW_BLOCK_MS = 1000  # one XREAD waits at most this long, so the idle deadline and Ctrl-C are seen promptly
DEFAULT_IDLE_TIMEOUT_S = 600.0

_STREAM_ID = re.compile(r"(\d+)(?:-(\d+))?")
_ULID = re.compile(r"[0-9A-HJKMNP-TV-Z]{26}", re.IGNORECASE)


def register(sub: Any, run_ref: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `events` subcommand to the CLI's subparsers."""
    p = sub.add_parser(
        "events",
        help="the run's log, one line per event (filters, --follow for a live run, --json for tools)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run_ref(p)
    p.add_argument("--type", action="append", default=[], metavar="TYPE", help="only this event type (repeatable)")
    p.add_argument("--group", action="append", default=[], metavar="GROUP", help="only events about group G (g000012)")
    p.add_argument("--rank", action="append", default=[], type=int, metavar="RANK", help="only events about rank R")
    p.add_argument(
        "--version", action="append", default=[], type=int, metavar="V", help="only events about policy version V"
    )
    p.add_argument("--since", metavar="ID|TIME", help="from this stream id, event id or ISO time (inclusive)")
    p.add_argument("--until", metavar="ID|TIME", help="up to this stream id, event id or ISO time (inclusive)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events until RunFinished (Ctrl-C)")
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        metavar="SECONDS",
        help=f"with --follow: stop after this long without a new entry (default {DEFAULT_IDLE_TIMEOUT_S:.0f})",
    )
    p.set_defaults(func=cmd_events)


# ---------------------------------------------------------------- --since / --until
@dataclass(frozen=True)
class Bound:
    """One end of the range: a stream id position (ms, seq), an event id to resolve, or a wall time."""

    text: str
    stream: tuple[int, int] | None = None
    event_id: str | None = None
    wall_time: float | None = None


def parse_bound(option: str, text: str, upper: bool) -> Bound:
    m = _STREAM_ID.fullmatch(text)
    if m:
        seq = int(m.group(2)) if m.group(2) is not None else (2**63 if upper else 0)
        return Bound(text, stream=(int(m.group(1)), seq))
    if _ULID.fullmatch(text):
        return Bound(text, event_id=text.upper())
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise CliError(
            f"{option} {text!r} is neither a stream id (1796155965864-0), an event id (a 26-character ULID) "
            "nor an ISO time (2026-12-02T14:39:42Z)"
        ) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return Bound(text, wall_time=t.timestamp())


def _position(stream_id: str) -> tuple[int, int]:
    from rolledger.workflows.replay import position  # here: `rolledger events` starts without loading the reducer

    return position(stream_id)


@dataclass
class Window:
    since: Bound | None
    until: Bound | None

    def resolve(self, entries: list[StoredEvent], option_names: tuple[str, str] = ("--since", "--until")) -> None:
        """Turn an event-id bound into the stream id of that event's entry."""
        by_id = {s.event.event_id: s.stream_id for s in entries}
        for name, attr in zip(option_names, ("since", "until"), strict=True):
            b: Bound | None = getattr(self, attr)
            if b is not None and b.event_id is not None:
                sid = by_id.get(b.event_id)
                if sid is None:
                    raise CliError(f"{name} {b.text!r}: no event with that id in the run's log")
                setattr(self, attr, Bound(b.text, stream=_position(sid), event_id=b.event_id))

    @staticmethod
    def _places(b: Bound, stream_id: str, wall_time: float | None) -> tuple[tuple[float, float], tuple[float, float]]:
        """The entry's place and the bound's, compared the bound's way (stream position, or wall time; an entry
        that did not decode has no wall time of its own: its stream id's milliseconds stand in)."""
        if b.stream is not None:
            ms, seq = _position(stream_id)
            return (float(ms), float(seq)), (float(b.stream[0]), float(b.stream[1]))
        assert b.wall_time is not None
        here = wall_time if wall_time is not None else _position(stream_id)[0] / 1000
        return (here, 0.0), (b.wall_time, 0.0)

    def before(self, stream_id: str, wall_time: float | None) -> bool:
        """The entry is before --since."""
        if self.since is None:
            return False
        here, bound = self._places(self.since, stream_id, wall_time)
        return here < bound

    def after(self, stream_id: str, wall_time: float | None) -> bool:
        """The entry is past --until."""
        if self.until is None:
            return False
        here, bound = self._places(self.until, stream_id, wall_time)
        return here > bound


# ---------------------------------------------------------------- the command
def _filter(args: argparse.Namespace) -> EventFilter:
    from rolledger.workflows.event_lines import EventFilter, unknown_type_message

    for t in args.type:
        msg = unknown_type_message(t)
        if msg is not None:
            raise CliError(msg)
    return EventFilter(frozenset(args.type), frozenset(args.group), frozenset(args.rank), frozenset(args.version))


class _Printer:
    """Folds every entry (for the causes an abort names) and prints those in the window that the filter selects."""

    def __init__(self, flt: EventFilter, window: Window, as_json: bool) -> None:
        from rolledger.workflows.event_lines import EventLines

        self.flt = flt
        self.window = window
        self.as_json = as_json
        self.fold: EventLines = EventLines()
        self.past_until = False
        self.since_met = window.since is None or window.since.event_id is None  # an event-id --since not yet seen

    def event(self, stored: StoredEvent) -> None:
        line = self.fold.line(stored.stream_id, stored.event)
        if self.past_until or self.window.after(stored.stream_id, stored.event.wall_time):
            self.past_until = True
            return
        w, event_id = self.window, stored.event.event_id
        # an event-id bound is exact within its entry too (an entry may hold several events, all at its position)
        if w.until is not None and w.until.event_id == event_id:
            self.past_until = True  # this one is shown, nothing after it
        if not self.since_met:
            if w.since is None or w.since.event_id != event_id:
                return
            self.since_met = True
        if self.window.before(stored.stream_id, stored.event.wall_time) or not self.flt.matches(stored.event):
            return
        self._out(json.dumps(line.to_dict(), default=str) if self.as_json else line.render())

    def undecodable(self, u: Undecodable) -> None:
        from rolledger.workflows.event_lines import undecodable_dict, undecodable_line

        if self.past_until or self.window.after(u.stream_id, None):
            self.past_until = True
            return
        if not self.since_met:
            return
        if self.window.before(u.stream_id, None) or not self.flt.may_match_undecodable(u.event_type):
            return
        if self.as_json:
            self._out(json.dumps(undecodable_dict(u.stream_id, u.event_type, u.reason)))
        else:
            self._out(undecodable_line(u.stream_id, u.event_type, u.reason))

    @staticmethod
    def _out(text: str) -> None:
        print(text, flush=True)


def cmd_events(args: argparse.Namespace) -> int:
    """Print the lines; a refused input or a missing run is one line on stderr and exit 2 (caught here, not only by
    `main`: under `python -m rolledger.workers.operator.cli` that module's CliError is another class than the one imported
    here)."""
    try:
        return _events(args)
    except CliError as exc:
        print(f"rolledger events: {exc}", file=sys.stderr)
        return 2


def _events(args: argparse.Namespace) -> int:
    from rolledger.events.store import StoredEvent

    flt = _filter(args)  # a misspelt type is refused before the run is opened
    window = Window(
        parse_bound("--since", args.since, upper=False) if args.since else None,
        parse_bound("--until", args.until, upper=True) if args.until else None,
    )
    if args.idle_timeout <= 0:
        raise CliError(f"--idle-timeout {args.idle_timeout} must be a positive number of seconds")
    try:
        with _open(args) as (client, run_id):
            scan = _scan(client, run_id)
            for problem in scan.problems:  # a missing or tampered archive segment: its events are not listed
                print(f"rolledger events: {problem.line()}", file=sys.stderr)
            window.resolve(scan.entries)
            printer = _Printer(flt, window, args.json)
            items: list[tuple[tuple[int, int], StoredEvent | Undecodable]] = [
                (_position(s.stream_id), s) for s in scan.entries
            ]
            items.extend((_position(u.stream_id), u) for u in scan.undecodable)
            items.sort(key=lambda kv: kv[0])
            finished = False
            last = "0-0"
            for _, item in items:
                last = item.stream_id
                if isinstance(item, StoredEvent):
                    printer.event(item)
                    finished = finished or item.event.type == "RunFinished"
                else:
                    printer.undecodable(item)
            if args.follow and not finished and not printer.past_until:
                _follow(client, run_id, last, printer, args.idle_timeout)
    except KeyboardInterrupt:  # Ctrl-C while following (or reading): quiet, the shell's code for SIGINT
        return 130
    return 0


def _follow(client: redis.Redis, run_id: str, last: str, printer: _Printer, idle_timeout_s: float) -> None:
    """New entries after `last` as they are appended (XREAD: a read), until RunFinished, --until or the idle timeout."""
    from rolledger.events.keys import log_key
    from rolledger.events.scan import scan_entry
    from rolledger.events.store import StoredEvent, as_str

    key = log_key(run_id)
    idle_until = time.monotonic() + idle_timeout_s
    while True:
        remaining_ms = int((idle_until - time.monotonic()) * 1000)
        if remaining_ms <= 0:
            print(f"rolledger events: nothing new for {idle_timeout_s:g} s; stopped following", file=sys.stderr)
            return
        reply: Any = client.xread({key: last}, count=500, block=max(1, min(FOLLOW_BLOCK_MS, remaining_ms)))
        if not reply:
            continue
        idle_until = time.monotonic() + idle_timeout_s
        for raw_id, fields in reply[0][1]:
            last = as_str(raw_id)
            for item in scan_entry(raw_id, fields):
                if isinstance(item, StoredEvent):
                    printer.event(item)
                    if item.event.type == "RunFinished":
                        return
                else:
                    printer.undecodable(item)
                if printer.past_until:
                    return
