"""A consumer process for the SIGKILL test (tests/test_consumer.py): reads one batch, completes some entries, starts
the next one, says KILLME on stdout and waits to be killed with its batch half done.

Completion = RPUSH to a completions list and XACK, in one MULTI/EXEC, so an entry is either completed-and-acked or
neither: that is what makes processing exactly-once on top of at-least-once delivery.

Usage: python tests/_consumer_proc.py URL RUN_ID GROUP CONSUMER BATCH COMPLETE_N
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from rolledger.events.connection import connect
from rolledger.events.consumer import Delivery, GroupConsumer
from rolledger.events.keys import log_key


def completions_key(run_id: str) -> str:
    return log_key(run_id) + ":test:completions"


def started_key(run_id: str) -> str:
    return log_key(run_id) + ":test:started"


def complete(client: redis.Redis, consumer: GroupConsumer, delivery: Delivery) -> None:
    """Record the completion and acknowledge the entry atomically."""
    pipe = client.pipeline(transaction=True)
    pipe.rpush(completions_key(consumer.run_id), f"{delivery.stream_id}|{consumer.consumer}|{delivery.deliveries}")
    pipe.xack(consumer.key, consumer.group, delivery.stream_id)
    pipe.execute()


def main(argv: list[str]) -> int:
    url, run_id, group, name, batch, complete_n = argv[0], argv[1], argv[2], argv[3], int(argv[4]), int(argv[5])
    client = connect(url)
    consumer = GroupConsumer(client, run_id, group, name)
    consumer.ensure_group()
    deliveries = consumer.read(count=batch, block_ms=5000)
    if len(deliveries) <= complete_n:
        print(f"ERROR only {len(deliveries)} deliveries", flush=True)
        return 2
    for delivery in deliveries[:complete_n]:
        complete(client, consumer, delivery)
    client.rpush(started_key(run_id), deliveries[complete_n].stream_id)  # work begun, never finished
    print(f"KILLME {len(deliveries)}", flush=True)
    sys.stdin.read()  # returns only if the test closes stdin instead of killing us
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
