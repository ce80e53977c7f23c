"""A rank's rollout slots: they generate the groups the rank takes from the `rollout` work group.

A rank runs `rank_slots` slots (RunConfig; 1 by default), each a thread with its own consumer of the `rollout` work
stream (events/work.py), which holds only the GroupAdmitted events (written there by the append that logs them). A
slot reads one group at a time and takes it only when it is free to run it, so the groups are balanced across ranks
(and slots) by readiness, and a rank has up to `rank_slots` groups in its engine at once (what continuous batching in
vLLM or SGLang needs to see more than one group's samples; the torch engine runs them one after another). A slot
waits until the rank may serve (`workflows.rank.may_serve` on the rank's folded state, under the rank's lock, where
the rank's running-group count is raised in the same step: shared by all slots, so no group starts after the rank
reported EnginePaused, and the drain waits for every slot's group), and generates the group: SampleStarted for each
sample, SampleFinished as each sample ends (streamed where the group can complete before all its samples end - first
k, a deadline - so it completes while the others still run; else all in one append when the last ends),
SampleCancelled for a sample cut short because the coordinator closed the group, SampleFailed when the engine fails.
A group reclaimed from a dead consumer first has its orphaned samples closed with SampleFailed, so no sample is
counted twice and none is left without a terminal event. A WorkerKilled from the engine (an injected fault) ends
that slot's thread without acknowledging its entry; the rank's control thread starts a new one for the slot (a new
consumer), and the entry is reclaimed by whichever consumer's XAUTOCLAIM finds it first. A SIGKILLed rank leaves one
pending entry per busy slot; other ranks reclaim each of them the same way.

Capacity (`rank_capacity`, decided by `workflows.rank.may_take` on the rank's `RankLoad`): in 'groups' (the default)
a slot takes a group when it is free, and the group holds the slot until its last sample ends. In 'sequences' a free
slot first waits, before it reads the work stream, until the rank has room for one more group of `group_size`
sequences beside the sequences still generating on it (counting the slots reading at that moment as such groups),
within `rank_max_seqs` (the engine's running-sequence limit); with a streaming engine each sample's sequence is
released as the sample ends (`on_sample`), so a group whose other samples ended holds one sequence of that room, not
a slot's worth: the rank's other slots take more groups while its straggler runs (continuous batching).

KV cache: where the engine reports its KV cache in tokens (vLLM, SGLang, the simulated engine; `kv_cache_tokens`), a
slot starts a group only if the worst case of the rank's running groups and this one (n x (prompt + max_tokens)
tokens each) fits in `kv_cache_cap` of it, or nothing runs on the rank: the slots never hand the engine more than
its cache holds, so it never preempts or recomputes a group of ours. The reservation is bookkeeping under the rank's
lock, made in the same step as the running count, so two slots cannot both take the last room.

Consumer names: slot 0 is the worker's name (`rank-R`, or `--name`), slot k>0 `NAME/sK`; a replacement thread adds
`.N` (its N-th thread). A restarted rank process with the same name reads each slot's own pending entries first.

Heartbeats: from the moment a group is delivered until its entry is acknowledged, the slot's heartbeat thread (one
per slot, for the slot's life) refreshes the claim every `recovery.heartbeat_s` (`GroupConsumer.refresh`, one round
trip per beat), so another rank reclaims the entry
only once this rank missed its beats for `recovery.lost_after_s` (a dead or stopped process), however long the group
takes. The reclaim deadline is "missed beats", not a budget per declared token: with a live heartbeat a long group
is never mistaken for a lost one, so no per-`max_tokens` estimate is needed. A rank that comes back after losing its
claim (a SIGSTOP past the deadline) learns it from its next beat, or from the ownership check made before every
append: it cuts the generation short and appends nothing more for that group (the reclaimer has closed its samples);
a result that raced past the check is counted by the reducer as a late result, not an anomaly.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

import redis

from rolledger.events.consumer import Delivery, GroupConsumer
from rolledger.schemas import events as ev
from rolledger.schemas.config import SamplingParams
from rolledger.schemas.statuses import GroupStatus, PolicyKind, SampleStatus
from rolledger.schemas.trajectory import Trajectory, VersionSpan
from rolledger.schemas.wire import encoded_size
from rolledger.workers.engines.protocol import (
    EngineCapabilities,
    GroupOutput,
    IllegalEngineOrder,
    SampleOutput,
    StaleRequest,
)
from rolledger.workers.runtime.runtime import Emitter, WorkerKilled
from rolledger.workflows.rank import RankLoad, may_serve, may_take
from rolledger.workflows.replay import position
from rolledger.workflows.update import about_to_be_quarantined

if TYPE_CHECKING:
    from rolledger.workers.roles.rank import RankWorker

_SEEN_WITHIN_S = 30.0  # how long a delivered group may take to reach the rank's folded state
_NO_CONFIG_CLAIM_MS = 30_000  # before the run's config is known (never: a rank serves only once it joined)


class ClaimLost(Exception):
    """Another consumer reclaimed the group this rank was working on: stop, append nothing more for it."""


class Claim:
    """A slot's claim on the one entry it works on; `lost` is set once a beat finds the entry owned by another
    consumer.

    A confirmed beat is trusted for `trust_s` (default: the smaller of `interval_s` and a quarter of the consumer's
    `claim_idle_ms`), measured from before it was sent: the beat reset the entry's idle time, so no consumer whose
    claim deadline is at least that long can have reclaimed it since. Within that window `owned` answers without a
    round trip, so the check before each streamed sample costs nothing while the beats are fresh."""

    def __init__(
        self,
        consumer: GroupConsumer,
        stream_id: str,
        interval_s: float,
        trust_s: float | None = None,
        confirmed_at: float = float("-inf"),
    ) -> None:
        self.consumer = consumer
        self.stream_id = stream_id
        self.trust_s = trust_s if trust_s is not None else min(interval_s, consumer.claim_idle_ms / 4000)
        self._confirmed = confirmed_at  # monotonic time the last confirming beat (or the delivery's read) was sent
        self.lost = threading.Event()

    def owned(self, *, fresh: bool = False) -> bool:
        """Beat now: is the entry still this consumer's? (A failed round trip is a missed beat, not a loss.)"""
        if self.lost.is_set():
            return False
        sent = time.monotonic()
        if not fresh and sent - self._confirmed < self.trust_s:
            return True
        try:
            mine = self.stream_id in self.consumer.refresh(self.stream_id)
        except redis.RedisError:
            return True
        if mine:
            self._confirmed = max(self._confirmed, sent)
        else:
            self.lost.set()
        return mine

    def check(self) -> None:
        """Before an append: raise ClaimLost when the entry is no longer this consumer's."""
        if not self.owned():
            raise ClaimLost(self.stream_id)


class Heartbeat:
    """One slot's heartbeat: a thread that lives as long as the slot and, every `interval_s()`, refreshes the claim
    the slot holds (`hold`), if any. One thread per slot, not one per group: starting and joining a thread per group
    cost more than the beats themselves. A claim is beaten within `interval_s` of being taken and then every
    `interval_s`, never less often than one thread per group would."""

    def __init__(self, name: str, interval_s: Callable[[], float]) -> None:
        self.interval_s = interval_s
        self._claim: Claim | None = None
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._beat, name=f"{name}-heartbeat", daemon=True)
        self._thread.start()

    @contextmanager
    def hold(self, claim: Claim) -> Iterator[Claim]:
        """Beat `claim` while the block runs."""
        with self._cv:
            self._claim = claim
        try:
            yield claim
        finally:
            with self._cv:
                self._claim = None

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=5.0)

    def _beat(self) -> None:
        while True:
            with self._cv:
                self._cv.wait(self.interval_s())  # woken early only by close
                if self._stopped:
                    return
                claim = self._claim
            if claim is not None and not claim.lost.is_set():
                claim.owned(fresh=True)  # a beat always refreshes: trust never stretches the time between beats


class Rollout:
    """The rank's rollout slots: `rank_slots` threads, each its own consumer of the `rollout` work group taking one
    group at a time (see the module docstring)."""

    def __init__(self, worker: RankWorker, claim_idle_ms: int | None) -> None:
        self.w = worker
        self.claim_idle_ms = claim_idle_ms
        self.incarnation = 0  # slot threads started so far (the first ones and every replacement)
        self.groups_done = 0  # written under the rank's lock
        self._slots: dict[int, threading.Thread] = {}  # slot -> its thread
        self.kv_reserved = 0  # KV tokens the running groups may take at most (written under the rank's lock)
        self.sequences = 0  # sequences of the running groups not yet ended (written under the rank's lock)
        self.reading = 0  # 'sequences': slots that passed the room gate and read the work stream (under the lock)
        self._kv_tokens: int | None = None  # the engine's KV cache in tokens (None: it reports none)
        self._kv_asked = False
        self._starts: dict[int, int] = {}  # slot -> how many threads it has had

    def slots(self) -> int:
        """How many groups this rank generates at once: the run's `rank_slots` (1 before the config is known)."""
        cfg = self.w.state.config
        return cfg.rank_slots if cfg is not None else 1

    def ensure_running(self) -> None:
        """Start every slot that has no live thread: the first time, and after one died (an injected WorkerKilled).
        A replacement is a new consumer: it reclaims the dead one's entry once its claim lapses."""
        if self.w.stop_event.is_set():
            return
        for k in range(self.slots()):
            thread = self._slots.get(k)
            if thread is None or not thread.is_alive():
                self._start(k)

    def _start(self, k: int) -> None:
        self.incarnation += 1
        n = self._starts[k] = self._starts.get(k, 0) + 1
        base = self.w.name if k == 0 else f"{self.w.name}/s{k}"
        name = base if n == 1 else f"{base}.{n}"
        consumer = GroupConsumer.work(self.w.client, self.w.run_id, "rollout", name, claim_idle_ms=self.claim_ms())
        consumer.ensure_group()
        if n > 1:
            self.w.logger.warning("rollout slot replaced", slot=k, consumer=name)
        # each slot appends as a producer of its own, so one producer's ids never go backwards in the log (two
        # slots of one rank stamp and append concurrently); its appends still count as the rank's (read-your-writes)
        emitter = self.w.emitter.as_producer(f"{self.w.name}/s{k}")
        self._slots[k] = threading.Thread(
            target=self._main, args=(consumer, emitter), name=f"{name}-rollout", daemon=True
        )
        self._slots[k].start()

    def ask_kv_cache(self) -> None:
        """Ask the engine for its KV cache size once (a slot does, before it takes work: never under the lock)."""
        if not self._kv_asked:
            self._kv_tokens, self._kv_asked = self.w.engine.kv_cache_tokens(), True

    def kv_budget(self) -> float:
        """The KV tokens this rank's running groups may take at most: `kv_cache_cap` of what the engine reports,
        unbounded where it reports nothing."""
        cfg = self.w.state.config
        if self._kv_tokens is None or self._kv_tokens <= 0 or cfg is None:
            return math.inf
        return cfg.kv_cache_cap * self._kv_tokens

    def load(self) -> RankLoad:
        """Under the lock: what this rank's rollout has running (`workflows.rank.may_take` decides on it)."""
        return RankLoad(self.w.running, self.sequences, self.kv_reserved)

    def _sequence_capacity(self) -> bool:
        cfg = self.w.state.config
        return cfg is not None and cfg.rank_capacity == "sequences"

    def _wait_for_room(self) -> bool:
        """'sequences': wait (under the lock) until the rank has room for one more group of `group_size` beside what
        runs and what the other slots are reading, then count this slot as reading. False: the rank is stopping."""
        with self.w.lock:
            while not self.w.stop_event.is_set():
                cfg = self.w.state.config
                if cfg is None or cfg.rank_capacity != "sequences":
                    return True
                load, r = self.load(), self.reading
                ahead = RankLoad(load.groups + r, load.sequences + r * cfg.group_size, load.kv_reserved)
                if may_take(cfg, ahead, cfg.group_size, 0, self.kv_budget()):
                    self.reading += 1
                    return True
                self.w.lock.wait(timeout=0.2)  # woken when a sequence or a group ends (and by every fold)
            return False

    def _done_reading(self, counted: bool) -> None:
        if counted:
            with self.w.lock:
                self.reading -= 1
                self.w.lock.notify_all()

    def claim_ms(self) -> int:
        """How long an entry may go without a heartbeat before this rank reclaims it: the override given to the worker
        (`--claim-idle-ms`), else the run's `recovery.lost_after_s`."""
        if self.claim_idle_ms is not None:
            return self.claim_idle_ms
        cfg = self.w.state.config
        return cfg.recovery.lost_after_ms if cfg is not None else _NO_CONFIG_CLAIM_MS

    def heartbeat_s(self) -> float:
        cfg = self.w.state.config
        return cfg.recovery.heartbeat_s if cfg is not None else 1.0

    def join(self, timeout: float) -> None:
        """Wake every slot and wait for them all, `timeout` seconds in all."""
        with self.w.lock:
            self.w.lock.notify_all()
        deadline = time.monotonic() + timeout
        for thread in list(self._slots.values()):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _main(self, consumer: GroupConsumer, emitter: Emitter) -> None:
        heartbeat = Heartbeat(consumer.consumer, self.heartbeat_s)
        try:
            self.ask_kv_cache()
            while not self.w.stop_event.is_set():
                gated = self._sequence_capacity()
                if gated and not self._wait_for_room():
                    return
                read_at = time.monotonic()  # a delivery resets the entry's idle time: the claim is fresh from here
                try:
                    deliveries = consumer.read(count=1, block_ms=100)
                except BaseException:
                    self._done_reading(gated)
                    raise
                for d in deliveries:
                    if not isinstance(d.event.payload, ev.GroupAdmitted):
                        consumer.ack(d.stream_id)
                        continue
                    if not self._generate_group(d, consumer, emitter, heartbeat, read_at, gated):
                        return
                    gated = False  # counted as reading until its group started (or was skipped)
                self._done_reading(gated)
        except WorkerKilled as exc:
            self.w.logger.warning("rollout slot killed by injection", consumer=consumer.consumer, reason=str(exc))
        except Exception:
            self.w.logger.exception("rollout slot crashed", consumer=consumer.consumer)
        finally:
            heartbeat.close()

    def _open(self, group_id: str) -> bool:
        g = self.w.state.groups.get(group_id)
        return g is not None and GroupStatus(g.status).is_open

    def _may_generate(self) -> bool:
        """Under the lock: the rank may generate on the state it has folded (`may_serve`), and the open update's abort
        is not about to quarantine it (then it starts nothing)."""
        return may_serve(
            self.w.state, self.w.rank, live_version=self.w.engine.policy_version, incarnation=self.w.incarnation
        ) and not about_to_be_quarantined(self.w.state, self.w.rank, time.time())

    def _admit(self, p: ev.GroupAdmitted) -> tuple[str, list[ev.Payload]]:
        """Under the lock: 'wait' (not in the folded state yet, or the rank may not serve), 'skip' (closed or
        reclaimed: the payloads close its orphans), or 'start' (the running count is raised)."""
        g = self.w.state.groups.get(p.group_id)
        if g is None:  # retired (terminal, owes nothing: closed before it could start here) or not folded yet
            return ("skip" if self.w.state.group_gone(p.group_id) is not None else "wait"), []
        if g.samples:  # reclaimed from a dead worker: close what it left open, never run a sample twice
            return "skip", [
                ev.SampleFailed(
                    sample_id=f"{p.group_id}/{s.index}",
                    group_id=p.group_id,
                    index=s.index,
                    rank=self.w.rank,
                    error="worker lost before the sample finished",
                )
                for s in g.samples.values()
                if s.status == SampleStatus.STARTED
            ]
        if not GroupStatus(g.status).is_open:  # closed before any sample started: nothing was dispatched
            return "skip", []
        if not self._may_generate():
            return "wait", []
        held = self.w.starts_held_through
        if held is not None:
            if held == "" or position(self.w.follower.last_id) < position(held):
                return "wait", []  # this rank reported a failed prepare that its follower has not folded yet
            self.w.starts_held_through = None
        need = kv_worst_case(p)
        cfg = self.w.state.config
        if cfg is not None and not may_take(cfg, self.load(), p.n, need, self.kv_budget()):
            return "wait", []  # no room beside what runs (KV worst case, sequences): wait for one to end
        self.w.running += 1
        self.w.announcing += 1
        self.kv_reserved += need
        self.sequences += p.n
        return "start", []

    def _generate_group(
        self,
        d: Delivery,
        consumer: GroupConsumer,
        emitter: Emitter,
        heartbeat: Heartbeat,
        read_at: float,
        reading: bool = False,
    ) -> bool:
        claim = Claim(consumer, d.stream_id, self.heartbeat_s(), confirmed_at=read_at)
        with heartbeat.hold(claim):
            try:
                return self._take_group(d, consumer, emitter, claim, reading)
            except ClaimLost:
                self.w.logger.warning("group reclaimed by another rank; dropping it", entry=d.stream_id)
                return True  # not ours to acknowledge any more

    def _take_group(
        self, d: Delivery, consumer: GroupConsumer, emitter: Emitter, claim: Claim, reading: bool = False
    ) -> bool:
        p = d.event.payload
        assert isinstance(p, ev.GroupAdmitted)
        seen_by = time.monotonic() + _SEEN_WITHIN_S
        with self.w.lock:
            if reading:  # the room this slot was counted for as a reader is now its group's (or free)
                self.reading -= 1
            while True:
                verdict, orphans = self._admit(p)
                if verdict != "wait":
                    break
                if self.w.stop_event.is_set():
                    return False
                if p.group_id not in self.w.state.groups and time.monotonic() > seen_by:
                    # leave it pending: another consumer (or we, later) reclaims it
                    self.w.logger.error("group never reached this rank's follower", group=p.group_id)
                    return True
                self.w.lock.wait(timeout=0.2)  # woken by every fold of the control thread
        if verdict == "skip":
            if orphans:
                claim.check()
            emitter.emit(orphans, policy_version=self.w.engine.policy_version, causation_id=d.event.event_id)
            consumer.ack(d.stream_id)
            return True
        done = False
        announced = [False]

        def announce() -> None:  # its SampleStarted is in the log (or never will be): a keep drain may report
            with self.w.lock:
                if not announced[0]:
                    announced[0] = True
                    self.w.announcing -= 1
                    self.w.lock.notify_all()

        ended: set[int] = set()  # samples whose sequence was released as they ended ('sequences')
        per_seq = kv_worst_case(p) // p.n

        def release(i: int) -> None:  # sample i ended in the engine: its sequence's room is free again
            with self.w.lock:
                if i not in ended:
                    ended.add(i)
                    self.sequences -= 1
                    self.kv_reserved -= per_seq
                    self.w.lock.notify_all()

        try:
            self._run(d, p, claim, emitter, announce, release if self._sequence_capacity() else None)
            consumer.ack(d.stream_id)
            done = True
            return True
        finally:
            announce()
            with self.w.lock:
                self.w.running -= 1
                self.kv_reserved -= kv_worst_case(p) - per_seq * len(ended)
                self.sequences -= p.n - len(ended)
                self.groups_done += done
                self.w.lock.notify_all()

    def _run(
        self,
        d: Delivery,
        p: ev.GroupAdmitted,
        claim: Claim,
        emitter: Emitter,
        announce: Callable[[], None],
        release: Callable[[int], None] | None = None,
    ) -> None:
        engine, rank = self.w.engine, self.w.rank
        ids = [f"{p.group_id}/{i}" for i in range(p.n)]
        version, digest = engine.policy_version, engine.weights_digest()

        def emit(*payloads: ev.Payload) -> None:
            claim.check()  # still ours? (a reclaimed group gets nothing more from this rank)
            emitter.emit(list(payloads), policy_version=engine.policy_version, causation_id=d.event.event_id)

        emit(
            *[
                ev.SampleStarted(
                    sample_id=ids[i],
                    group_id=p.group_id,
                    index=i,
                    rank=rank,
                    policy_version=version,
                    weights_digest=digest,
                )
                for i in range(p.n)
            ]
        )
        announce()
        started = time.perf_counter()

        def should_cancel(_: int) -> bool:
            if claim.lost.is_set():
                return True
            with self.w.lock:
                return not self._open(p.group_id)

        streamed: set[int] = set()
        refused = False  # by an engine paused or already serving a newer version: cut before the first token

        close_early = may_close_early(p)

        def on_sample(i: int, s: SampleOutput) -> None:
            if release is not None:
                release(i)  # its sequence's room is free: another slot may take a group now
            if not close_early:
                return  # logged with the group, in one append
            # one sample ended: log it now, so a first-k group can complete while the others still run
            so_far = GroupOutput([], version, digest, engine.cache_generation, engine.graph_generation)
            emit(self._finished(p, self._trajectory(p, i, s, so_far), (time.perf_counter() - started) * 1e3))
            streamed.add(i)

        def fail_open(exc: Exception) -> None:
            """The engine failed: every sample not yet logged as finished fails (the rank fails closed)."""
            emit(
                *[
                    ev.SampleFailed(sample_id=ids[i], group_id=p.group_id, index=i, rank=rank, error=str(exc))
                    for i in range(p.n)
                    if i not in streamed  # a sample already logged as finished has its terminal event
                ]
            )

        try:
            # expect_version: the samples are logged as started on `version`; a whole update (a keep drain needs
            # only that SampleStarted be in the log) may commit before the request reaches the engine, which then
            # refuses it (StaleRequest) rather than run it on weights its stamp does not name
            if engine.capabilities.streams_samples and (close_early or release is not None):
                out = engine.generate(
                    p.prompt_token_ids,
                    p.n,
                    p.sampling,
                    should_cancel=should_cancel,
                    on_sample=on_sample,  # type: ignore[call-arg]  # streaming engines (capabilities.streams_samples)
                    expect_version=version,
                )
            else:  # the group completes only once every sample ended: one append for all of them
                out = engine.generate(
                    p.prompt_token_ids, p.n, p.sampling, should_cancel=should_cancel, expect_version=version
                )
        except (WorkerKilled, ClaimLost):
            raise
        except IllegalEngineOrder as exc:
            if not (engine.is_paused or isinstance(exc, StaleRequest)):
                fail_open(exc)
                return
            refused = True
            # a drain paused the engine, or a whole update committed, between this group's start and its request:
            # every sample is cut before its first token, as that pause would have cut it (recycled or cancelled
            # below, not failed); recycled, each says its start version in an empty first span
            out = GroupOutput(
                [SampleOutput([], [], "abort") for _ in range(p.n)],
                version,
                digest,
                engine.cache_generation,
                engine.graph_generation,
            )
        except Exception as exc:  # noqa: BLE001 - any failure is reported as an event; the rank fails closed
            fail_open(exc)
            return
        # a sample without spans ran on one version: the one the group started on (its SampleStarted stamp), not the
        # one serving when the group ended (an interruptible group spans a commit; its early samples ended before it)
        started_on = GroupOutput(out.samples, version, digest, out.cache_generation, out.graph_generation)
        with self.w.lock:
            cfg = self.w.state.config
        # refused in an interruptible run: continued on what serves next, as a sample the drain parked would be
        if cfg is not None and (cfg.recycle_aborted or (refused and cfg.interruptible)):
            try:
                started_on = self._recycle(p, started_on, claim, should_cancel, skip=streamed)
            except (WorkerKilled, ClaimLost):
                raise
            except Exception as exc:  # noqa: BLE001 - as above
                fail_open(exc)
                return
        gen_ms = (time.perf_counter() - started) * 1e3
        emit(*self._results(p, started_on, gen_ms, skip=streamed))

    # ------------------------------------------------------------------ recycling aborted samples

    def _recycle(
        self,
        p: ev.GroupAdmitted,
        out: GroupOutput,
        claim: Claim,
        should_cancel: Callable[[int], bool],
        skip: set[int],
    ) -> GroupOutput:
        """`recycle_aborted`: every sample an abort drain cut short is continued from its own tokens once this rank
        serves again (the update committed or aborted), until none is cut or the group may not
        go on (closed, reclaimed, the rank stopping): those end as they are (cancelled, `_results`). Each stretch of
        tokens keeps the version that produced it (spans)."""
        samples = dict(enumerate(out.samples))
        while cut := [i for i, s in samples.items() if s.finish_reason == "abort" and i not in skip]:
            if not self._wait_to_continue(p, claim):
                break
            samples.update(self._continue_all(p, {i: samples[i] for i in cut}, out, should_cancel))
        return GroupOutput(
            [samples[i] for i in range(len(out.samples))],
            out.policy_version,
            out.weights_digest,
            out.cache_generation,
            out.graph_generation,
        )

    def _continue_all(
        self,
        p: ev.GroupAdmitted,
        cut: dict[int, SampleOutput],
        out: GroupOutput,
        should_cancel: Callable[[int], bool],
    ) -> dict[int, SampleOutput]:
        """The cut samples continued at once, each its own engine request (the engine batches them as it batches
        the slots' groups): one after the other they would take the sum of their times, and the next drain could cut
        them again before the last one started. A sample whose request the engine refused because it was paused again
        (the next drain, between the wait and the call) is left out: it stays cut and waits for the next turn."""
        name = threading.current_thread().name
        with ThreadPoolExecutor(max_workers=len(cut), thread_name_prefix=f"{name}-recycle") as pool:
            futures = {i: pool.submit(self._continued, p, i, s, out, should_cancel) for i, s in cut.items()}
        continued: dict[int, SampleOutput] = {}
        for i, f in futures.items():
            try:
                continued[i] = f.result()
            except IllegalEngineOrder:
                pass
        return continued

    def _wait_to_continue(self, p: ev.GroupAdmitted, claim: Claim) -> bool:
        """Wait until this rank may generate again (as a group's start does, `_admit`); False when the group may not
        go on. The slot does not count as running meanwhile: the drain it waits out needs none running."""
        with self.w.lock:
            self.w.running -= 1
            self.w.lock.notify_all()
            try:
                while not (self.w.stop_event.is_set() or claim.lost.is_set() or not self._open(p.group_id)):
                    if self._may_generate() and not self.w.engine.is_paused:
                        return True
                    self.w.lock.wait(timeout=0.2)  # woken by every fold of the control thread
                return False
            finally:
                self.w.running += 1

    def _continued(
        self, p: ev.GroupAdmitted, i: int, s: SampleOutput, out: GroupOutput, should_cancel: Callable[[int], bool]
    ) -> SampleOutput:
        """Sample `i`, cut after its k tokens, continued from them by the engine as it serves now: the tokens and
        logprobs of both stretches, the continuation's finish reason, and a span per version (none: one version)."""
        k = len(s.token_ids)
        seed = None if p.sampling.seed is None else (p.sampling.seed * 1_000_003 + i * 65_537 + k) % 2**31
        sampling = p.sampling.model_copy(update={"max_tokens": p.sampling.max_tokens - k, "seed": seed})
        more = self.w.engine.generate([*p.prompt_token_ids, *s.token_ids], 1, sampling, should_cancel=should_cancel)
        c = more.samples[0]
        before = s.spans or ((0, out.policy_version, out.weights_digest),)
        after = c.spans or ((0, more.policy_version, more.weights_digest),)
        spans: list[tuple[int, int, str]] = []
        for start, version, digest in [*before, *((k + b, v, d) for b, v, d in after)]:
            if not spans or spans[-1][1:] != (version, digest):  # the same weights on both sides: one stretch
                spans.append((start, version, digest))
        return SampleOutput(
            token_ids=[*s.token_ids, *c.token_ids],
            logprobs=[*s.logprobs, *c.logprobs],
            finish_reason=c.finish_reason,
            spans=tuple(spans) if len(spans) > 1 else (),
        )

    def _results(self, p: ev.GroupAdmitted, out: GroupOutput, gen_ms: float, skip: set[int]) -> list[ev.Payload]:
        results: list[ev.Payload] = []
        for i, s in enumerate(out.samples):
            if i in skip:
                continue
            sid = f"{p.group_id}/{i}"
            if s.finish_reason == "abort":
                results.append(
                    ev.SampleCancelled(
                        sample_id=sid,
                        group_id=p.group_id,
                        index=i,
                        reason="cancelled while generating",
                        tokens=len(s.token_ids),
                    )
                )
                continue
            results.append(self._finished(p, self._trajectory(p, i, s, out), gen_ms))
        return results

    def _finished(self, p: ev.GroupAdmitted, t: Trajectory, gen_ms: float) -> ev.Payload:
        """A finished sample's event, with its encoded size; a sample that encodes larger than its group reserved
        per sample at admission (`GroupAdmitted.est_bytes`, workflows/admission.sample_reserve) fails instead, so the
        completed groups never hold more bytes than admission counted."""
        nbytes = encoded_size(t)
        reserve = p.est_bytes // p.n
        if nbytes > reserve:
            error = f"its trajectory encodes to {nbytes} B, over the {reserve} B reserved per sample at admission"
            return ev.SampleFailed(
                sample_id=t.trajectory_id, group_id=p.group_id, index=t.index, rank=t.rank, error=error
            )
        return ev.SampleFinished(trajectory=t, answer=p.answer, gen_ms=gen_ms, nbytes=nbytes)

    def _trajectory(self, p: ev.GroupAdmitted, i: int, s: SampleOutput, out: GroupOutput) -> Trajectory:
        start = len(p.prompt_token_ids)
        spans = tuple(
            VersionSpan(
                start=b,
                end=s.spans[k + 1][0] if k + 1 < len(s.spans) else len(s.token_ids),
                policy_version=v,
                weights_digest=dg,
            )
            for k, (b, v, dg) in enumerate(s.spans)
        )
        # a trajectory says the version it started on; its spans say which version produced which tokens
        version, digest = (
            (spans[0].policy_version, spans[0].weights_digest) if spans else (out.policy_version, out.weights_digest)
        )
        return Trajectory(
            trajectory_id=f"{p.group_id}/{i}",
            group_id=p.group_id,
            prompt_id=p.prompt_id,
            index=i,
            prompt_token_ids=p.prompt_token_ids,
            token_ids=s.token_ids,
            loss_mask=[1] * len(s.token_ids),
            positions=list(range(start, start + len(s.token_ids))),
            logprobs=s.logprobs,
            logprob_mode=logprob_mode_of(self.w.engine.capabilities, p.sampling),
            finish_reason=s.finish_reason,
            sampling=p.sampling,
            policy_version=version,
            weights_digest=digest,
            spans=spans,
            rank=self.w.rank,
            engine=self.w.engine.capabilities.name,
            cache_generation=out.cache_generation,
            graph_generation=out.graph_generation,
        )


def kv_worst_case(p: ev.GroupAdmitted) -> int:
    """The most KV cache tokens a group can take: every sample at its `max_tokens` after the prompt."""
    return p.n * (len(p.prompt_token_ids) + p.sampling.max_tokens)


def may_close_early(p: ev.GroupAdmitted) -> bool:
    """Can the group complete before all its samples end? First k completes at the k-th, a deadline cuts it with the
    samples finished by then: their samples are logged as each ends (streamed). Otherwise a group completes only when
    every sample ended, and streaming would cost an append per sample for nothing."""
    return p.partial_policy.kind == PolicyKind.FIRST_K or p.deadline is not None


def logprob_mode_of(caps: EngineCapabilities, sampling: SamplingParams) -> Literal["raw", "processed"]:
    """The mode a sample's logprobs are in: the request's where the engine honours it per request (torch), else the
    engine's (vLLM: a server setting). Stamped on the trajectory; the trainer's agreement compares in that mode."""
    if caps.logprob_mode_per_request:
        return "processed" if sampling.logprob_mode == "processed" else "raw"
    return caps.logprob_mode
