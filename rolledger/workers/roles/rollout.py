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

Heartbeats: from the moment a group is delivered until its entry is acknowledged, the slot's heartbeat refreshes
its claim, so another rank reclaims it only once this rank missed its beats (workers/roles/claims.py).
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING

from rolledger.events.consumer import Delivery, GroupConsumer
from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.schemas.statuses import GroupStatus, SampleStatus
from rolledger.workers.roles.claims import Claim, ClaimLost, Heartbeat
from rolledger.workers.roles.episodes import Episodes
from rolledger.workers.roles.group_run import run_group
from rolledger.workers.runtime.runtime import Emitter, WorkerKilled
from rolledger.workflows.rank import RankLoad, may_serve, may_take
from rolledger.workflows.replay import position
from rolledger.workflows.update import about_to_be_quarantined

if TYPE_CHECKING:
    from rolledger.workers.roles.rank import RankWorker

_SEEN_WITHIN_S = 30.0  # how long a delivered group may take to reach the rank's folded state
_NO_CONFIG_CLAIM_MS = 30_000  # before the run's config is known (never: a rank serves only once it joined)


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
        self._episodes: Episodes | None = None  # the task's environment (task.env), started on the first episode
        self._episodes_lock = threading.Lock()

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
        with self._episodes_lock:
            if self._episodes is not None:
                self._episodes.close()  # its environment processes end with the rank

    def episodes(self, cfg: RunConfig) -> Episodes:
        """The rank's episodes (its environment's processes, the rank's tokenizer), made on first use."""
        with self._episodes_lock:
            if self._episodes is None:
                self._episodes = Episodes(cfg.task, getattr(self.w, "tokenizer", None))
            return self._episodes

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
        need = kv_worst_case(p, self.w.state.config)
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
        with self.w.lock:
            worst = kv_worst_case(p, self.w.state.config)
        per_seq = worst // p.n

        def release(i: int) -> None:  # sample i ended in the engine: its sequence's room is free again
            with self.w.lock:
                if i not in ended:
                    ended.add(i)
                    self.sequences -= 1
                    self.kv_reserved -= per_seq
                    self.w.lock.notify_all()

        try:
            run_group(self, d, p, claim, emitter, announce, release if self._sequence_capacity() else None)
            consumer.ack(d.stream_id)
            done = True
            return True
        finally:
            announce()
            with self.w.lock:
                self.w.running -= 1
                self.kv_reserved -= worst - per_seq * len(ended)
                self.sequences -= p.n - len(ended)
                self.groups_done += done
                self.w.lock.notify_all()


def kv_worst_case(p: ev.GroupAdmitted, cfg: RunConfig | None = None) -> int:
    """The most KV cache tokens a group can take: every sample at its `max_tokens` after the prompt, or, in a run
    whose task has an environment, at its episode's `task.max_episode_tokens`."""
    width = cfg.task.max_episode_tokens if cfg is not None and cfg.task.env is not None else p.sampling.max_tokens
    return p.n * (len(p.prompt_token_ids) + width)
