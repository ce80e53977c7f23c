"""What every worker and coordinator shares: following the log into a RunState, and appending stamped events.

A `Follower` tails the run's log from its first entry and folds every event through the reducer, so a process that
restarts rebuilds exactly the state it had; the followers of one process share one read and one decode of the log
(workers/runtime/shared_tail.py). `shared_follower` is one fold for several roles of a process that decide on the same
state under one lock (the rank workers and the reward worker: `rolledger run` holds all ranks in one process, and 16
ranks folding every event 16 times was half of the control plane's CPU, bench/bench_scale.py). The coordinator and
the trainer keep their own fold: their decisions are long scans of the state, which would hold the ranks' fold. An
`Emitter` wraps payloads into envelopes (id, producer, causation, policy version in force) and appends them; after
the run's RunFinished the store refuses appends (RunClosed) and the emitter drops them with one log line, so a worker
still finishing its last action when the run ends stops cleanly on its next fold instead of crashing. `Worker` is the
small base class with the stop flag and the loop; a Redis outage longer than the connection's deadline ends it with
`RedisUnavailable` (workers/operator/processes.py exits 3).
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Sequence

import redis
import structlog

from rolledger.events.archive import trimmed_before
from rolledger.events.envelope import make_event
from rolledger.events.outage import RedisUnavailable
from rolledger.events.snapshots import latest_snapshot
from rolledger.events.store import ConcurrencyConflict, EventLog, LogLostEntries, RunClosed, StoredEvent
from rolledger.schemas import events as ev
from rolledger.workers.runtime.shared_tail import PerRun, shared_tail
from rolledger.workflows.reducer import fold
from rolledger.workflows.replay import position, restore
from rolledger.workflows.state import RunState


class Follower:
    """Tails the log and folds it; `state` is always the fold of everything up to `last_id`.

    Every follower of a process reads through the process's one tail of the run (workers/runtime/shared_tail.py): the log
    is read and decoded once per process, whatever the number of roles following it.

    `lock`: for a state other threads read (a rank's rollout thread) or fold (the ranks of `shared_follower`):
    `catch_up` places and folds under it and notifies it. Two threads may fetch overlapping entries from the tail;
    under the lock each event is folded once, by whichever comes first (the other skips what the state already
    holds)."""

    def __init__(self, log: EventLog, lock: threading.Condition | None = None) -> None:
        self.log = log
        self.state = RunState()
        self.last_id = "0-0"
        self.lock = lock
        self._placed = False
        self.tail = shared_tail(log)
        self.tail.register(self)

    def start_from(self, state: RunState, stream_id: str) -> None:
        """Begin at a snapshot (state as of `stream_id`) instead of the first entry: replay = snapshot + tail."""
        self.state, self.last_id = state, stream_id
        self._placed = True

    def _place(self) -> None:
        """Once, before the first read of a follower starting at the first entry: if the archiver trimmed the live
        stream (events/archive.py), the first entries are only in the archive; begin at the latest snapshot instead,
        which the archiver never trims past (one HGET, plus the snapshot when there is a trim)."""
        if self._placed:
            return
        self._placed = True
        if self.last_id != "0-0" or trimmed_before(self.log.client, self.log.run_id) is None:
            return
        snap = latest_snapshot(self.log.client, self.log.run_id)
        if snap is not None:
            self.start_from(restore(snap), snap.stream_id)

    def poll(self, block_ms: int = 100) -> list[StoredEvent]:
        """Fold what has arrived after our position, waiting up to `block_ms` for a first entry."""
        with self._guard():
            self._place()
        got = self.tail.after(self.last_id, block_ms=block_ms)
        return self._fold(got)

    def _guard(self) -> contextlib.AbstractContextManager[object]:
        return self.lock if self.lock is not None else contextlib.nullcontext()

    def _fold(self, got: list[StoredEvent]) -> list[StoredEvent]:
        """Fold the fetched entries the state does not hold yet (under the lock; notified); returns them."""
        if not got:
            return got
        with self._guard():
            # another thread may have folded some or all of them meanwhile (they are in stream order)
            new = got[bisect.bisect_right(got, position(self.last_id), key=lambda s: position(s.stream_id)) :]
            if not new:
                return new
            for stored in new:
                fold(self.state, stored.event)
                self.last_id = stored.stream_id
            if self.lock is not None:
                self.lock.notify_all()
        return new

    def catch_up(self, block_ms: int = 0, *, through: str | None = None) -> list[StoredEvent]:
        """Fold everything appended so far (waiting up to `block_ms` for the first new entry; 0: do not wait): the
        whole log up to its last entry as of this call, however long. Returns the events folded.

        `through`: fold at least up to this stream id instead of the log's end as of this call (one round trip
        less): a worker that must see its own appends passes its emitter's `last_id`, and takes what other
        processes appended as the process's tail brings it ("0-0": only what the tail already has)."""
        with self._guard():
            self._place()
        target = through if through is not None else self.log.last_id()
        got = self.tail.after(self.last_id, block_ms=block_ms, through=target)
        return self._fold(got)


class LockedFollower(Follower):
    """A Follower that always has its lock (a Condition notified after every fold): what roles sharing one fold read
    the state under."""

    lock: threading.Condition

    def __init__(self, log: EventLog) -> None:
        super().__init__(log, threading.Condition())


_SHARED: PerRun[LockedFollower] = PerRun()


def shared_follower(log: EventLog) -> LockedFollower:
    """This process's one fold of `log`'s run on `log`'s connection pool, with its lock (a Condition), for roles
    that share it (made on first use, kept while one of them holds it).

    What sharing asks of its users: the state changes whenever any of them folds, so they read it under `lock` only
    (decisions included), and a role that must see its own report folded before it acts again (a rank's
    EnginePaused) waits for it by its stream id, not by "nobody folds until I do"."""
    return _SHARED.get(log, LockedFollower)


class Emitter:
    """Appends events from one producer, stamped with the policy version in force. Appends the store refuses
    because the run is over are dropped (logged once); `closed` says whether that happened."""

    def __init__(self, log: EventLog, producer: str, parent: Emitter | None = None) -> None:
        self.log = log
        self.producer = producer
        self.closed = False
        self.last_id = "0-0"  # stream id of the newest event this emitter appended (what read-your-writes needs)
        self._last_lock = threading.Lock()  # several threads append (a rank's control thread and its rollout slots)
        self._parent = parent

    def as_producer(self, producer: str) -> Emitter:
        """An emitter appending as `producer` whose appends (and a refusal because the run is over) count as this
        one's too: a rank's rollout slot, one producer per thread, inside the rank's read-your-writes."""
        return Emitter(self.log, producer, parent=self)

    def _appended(self, ids: Sequence[str]) -> None:
        with self._last_lock:  # check and set as one: a slower thread never moves last_id back
            if ids and position(ids[-1]) > position(self.last_id):
                self.last_id = ids[-1]
        if self._parent is not None:
            self._parent._appended(ids)

    def refused(self, exc: RunClosed, payloads: Sequence[ev.Payload]) -> None:
        if not self.closed:
            structlog.get_logger("emitter").info(
                "run is over, not appending", producer=self.producer, events=[p.type for p in payloads], why=str(exc)
            )
        self.closed = True
        if self._parent is not None:
            self._parent.closed = True

    def wrap(
        self,
        payload: ev.Payload,
        *,
        policy_version: int,
        causation_id: str | None = None,
        correlation_id: str | None = None,
    ) -> ev.Event:
        return make_event(
            payload,
            run_id=self.log.run_id,
            producer=self.producer,
            policy_version=policy_version,
            causation_id=causation_id,
            correlation_id=correlation_id,
        )

    def emit(
        self,
        payloads: Sequence[ev.Payload],
        *,
        policy_version: int,
        causation_id: str | None = None,
        correlation_id: str | None = None,
    ) -> list[str]:
        if not payloads:
            return []
        events = [
            self.wrap(p, policy_version=policy_version, causation_id=causation_id, correlation_id=correlation_id)
            for p in payloads
        ]
        try:
            ids = self.log.append_many(events)
        except RunClosed as exc:
            self.refused(exc, payloads)
            return []
        self._appended(ids)
        return ids

    def emit_if(
        self,
        payloads: Sequence[ev.Payload],
        *,
        expected_last_id: str,
        policy_version: int,
        causation_id: str | None = None,
    ) -> bool:
        """Append only if nothing was appended since `expected_last_id`; False on a conflict (re-decide and retry)."""
        events = [self.wrap(p, policy_version=policy_version, causation_id=causation_id) for p in payloads]
        try:
            self._appended(self.log.append_if(events, None if expected_last_id == "0-0" else expected_last_id))
        except ConcurrencyConflict:
            return False
        except RunClosed as exc:
            self.refused(exc, payloads)
            return False
        return True


class WorkerKilled(RuntimeError):
    """Raised inside a worker by a kill-worker injection: the thread dies without acknowledging its work."""


class Worker:
    """A stoppable loop on its own thread (or the main thread of a `rolledger worker` process)."""

    kind = "worker"

    def __init__(self, client: redis.Redis, run_id: str, name: str) -> None:
        self.client = client
        self.run_id = run_id
        self.name = name
        self.log = EventLog(client, run_id)
        self.emitter = Emitter(self.log, name)
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.logger = structlog.get_logger(self.kind).bind(run=run_id, worker=name)
        self._thread: threading.Thread | None = None

    def run(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def respawn(self) -> Worker | None:
        """A fresh incarnation under a new name, as a restarted process would be; None if this kind is not restarted."""
        return None

    def next_name(self) -> str:
        base, _, n = self.name.partition("#")
        return f"{base}#{int(n or 1) + 1}"

    def _main(self) -> None:
        try:
            self.run()
        except WorkerKilled as exc:
            self.error = exc
            self.logger.warning("worker killed by injection", reason=str(exc))
        except RedisUnavailable as exc:  # one line, no traceback: the outage outlasted the deadline
            self.error = exc
            self.logger.error("giving up: redis unavailable", error=str(exc))
        except LogLostEntries as exc:  # one line: the log is behind what this worker read (its restart folds it anew)
            self.error = exc
            self.logger.error("the log lost entries", error=str(exc))
        except BaseException as exc:  # a crash is reported, never swallowed
            self.error = exc
            self.logger.exception("worker crashed")

    def start(self) -> threading.Thread:
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        self.stop_event.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
