"""The Redis Cluster client `events.connection.connect` gives for `redis+cluster://` URLs: `ClusterClient`,
redis-py's `RedisCluster` whose every command rides out an outage and a failover under the same deadline as a
single server's (events/outage.py), whose Lua scripts survive a failover's empty script cache (`SlotScript`), and
whose blocking reads cut short by a node turning replica are retried on the new layout (`RoleChanged`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import NoScriptError, ResponseError
from redis.retry import Retry

from rolledger.events.outage import OutageRetry, no_op


class RoleChanged(redis.ConnectionError):
    """A blocking read (XREAD/XREADGROUP BLOCK) cut short by its node turning replica in a failover (`-UNBLOCKED`):
    nothing was delivered, so it is retried like an outage, on the new layout."""


class SlotScript(Script):
    """A Lua script on a Redis Cluster: EVALSHA, and on NOSCRIPT the script itself with EVAL, routed by its keys'
    slot as EVALSHA is (which caches it on that node). redis-py's own fallback loads the script with SCRIPT LOAD and
    tries EVALSHA again, but after a failover the promoted replica's script cache is empty and SCRIPT LOAD may go to
    the nodes of a layout the client has not refreshed yet: the second EVALSHA failed too, and the worker with it."""

    def __call__(self, keys: Sequence[Any] | None = None, args: Iterable[Any] | None = None, client: Any = None) -> Any:
        keys, args = list(keys or []), tuple(args or ())
        target = client if client is not None else self.registered_client
        try:
            return target.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return target.eval(cast(str, self.script), len(keys), *keys, *args)


class ClusterClient(RedisCluster):
    """redis-py's RedisCluster whose commands ride out an outage (and a failover) like `connect`'s single-node client:
    every command goes through `outage_retry` (an `OutageRetry` over `CLUSTER_RETRY_ON`), on top of redis-py's own
    handling of MOVED/ASK redirections and one layout refresh per failed attempt."""

    def __init__(self, *, outage_retry: OutageRetry, **kwargs: Any) -> None:
        self.outage_retry = outage_retry  # first: the constructor already sends commands (COMMAND)
        # redis-py retries a failed command once itself, after re-reading the layout; the deadline is ours
        super().__init__(retry=Retry(NoBackoff(), 1), **kwargs)

    def register_script(self, script: Any) -> SlotScript:
        return SlotScript(self, script)

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        base = super().execute_command

        def attempt() -> Any:
            try:
                return base(*args, **kwargs)
            except ResponseError as exc:
                if not str(exc).startswith("UNBLOCKED"):
                    raise
                self.nodes_manager.initialize()  # the node turned replica: read the layout again, then retry
                raise RoleChanged(str(exc)) from exc

        return self.outage_retry.call_with_retry(attempt, no_op)

    def at_key(self, key: str, *args: Any) -> Any:
        """Run a keyless command on the primary serving `key`'s slot (looked up again on every retry)."""
        base = super().execute_command
        return self.outage_retry.call_with_retry(lambda: base(*args, target_nodes=self.get_node_from_key(key)), no_op)
