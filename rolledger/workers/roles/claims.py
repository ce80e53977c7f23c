"""A rollout slot's claim on the group it generates, and the slot's heartbeat that keeps it (workers/roles/rollout.py).

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

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

from rolledger.events.consumer import GroupConsumer


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
