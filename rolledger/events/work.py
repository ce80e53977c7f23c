"""Work queues: the commands a worker must act on, derived from the log by their producer.

The log is the source of truth and is never trimmed by length; a worker that must *act* on some events (a rank on
GroupAdmitted, the reward worker on SampleFinished) does not consume the log. Each such event is also written, by
the append script that writes it to the log (events/store.py, the same Lua call: both or neither), to the work
stream of the consumer group that acts on it (`events.keys.work_key(run, group)`). That stream holds only those
events, as entries `e` (the same codec bytes), `t` (the type) and `s` (the event's stream id in the log; `k` its
place in that log entry when the entry holds several events). Its
consumer group (events.consumer, `GroupConsumer.work`) reads it in batches, reclaims on a timer, acknowledges each
entry once and deletes it with the acknowledgement, so a work stream holds only work not yet done.

`ROUTES`: event type -> the consumer group whose work stream receives it. A type is routed to at most one group.
"""

from __future__ import annotations

from typing import Final

ROUTES: Final[dict[str, str]] = {
    "GroupAdmitted": "rollout",  # a rank generates the group (workers/roles/rollout.py)
    "SampleFinished": "reward",  # the reward worker scores the sample (workers/roles/reward.py)
}

GROUPS: Final[tuple[str, ...]] = tuple(sorted(set(ROUTES.values())))

# Groups whose work stream takes the events of one append as one entry (`b`: their bytes, `t`: their types, `k`:
# their places in the log entry, comma-joined): the reward worker scores what it reads as one batch and acknowledges
# it at once. A rank takes one group per entry (its claim and heartbeat are per entry), so "rollout" is not one.
BATCHED: Final[frozenset[str]] = frozenset({"reward"})

LOG_ID_FIELD: Final = b"s"  # a work entry's field holding the event's stream id in the log
LOG_INDEX_FIELD: Final = b"k"  # ... and its place in that log entry (comma-joined for a batch), when it holds several
