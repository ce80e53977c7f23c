"""Redis key names of a run: the one place they are spelled. Every key of a run shares the hash tag `{<run-id>}` so a
Redis Cluster keeps it on one slot (multi-key Lua scripts then work). Field names inside an entry belong to the
module that writes it (events/store.py for the log, events/snapshots.py for snapshots)."""

from __future__ import annotations


def _k(run_id: str, suffix: str) -> str:
    if "{" in run_id or "}" in run_id:
        raise ValueError(f"run id {run_id!r} may not contain braces (they delimit the Redis Cluster hash tag)")
    return f"rolledger:{{{run_id}}}:{suffix}"


def every_run_key() -> str:
    """The key pattern that covers every key of every run (what an ACL user of rolledger needs: `~rolledger:*`)."""
    return "rolledger:*"


def log_key(run_id: str) -> str:
    """The run's event log: the source of truth. Never trimmed by length; only the archiver (events/archiver.py)
    trims it, by MINID, behind entries it has written to verified archive segments."""
    return _k(run_id, "events")


def dead_letter_key(run_id: str) -> str:
    """Entries a consumer could not process (malformed, unknown type, newer schema, too many deliveries)."""
    return _k(run_id, "deadletter")


def dead_letter_seen_key(run_id: str) -> str:
    """Hash source stream id -> dead-letter id: what was already dead-lettered (so each entry is copied once)."""
    return dead_letter_key(run_id) + ":seen"


def dedupe_key(run_id: str) -> str:
    """Hash event id -> stream id, for idempotent appends."""
    return _k(run_id, "dedupe")


def snapshots_key(run_id: str) -> str:
    """Stream of reducer snapshots (state, digest, last event id)."""
    return _k(run_id, "snapshots")


def lease_key(run_id: str, role: str) -> str:
    """Leader lease of a coordinator role."""
    return _k(run_id, f"lease:{role}")


def fence_key(run_id: str, role: str) -> str:
    """Monotonic fencing-token counter of a coordinator role."""
    return _k(run_id, f"fence:{role}")


def work_key(run_id: str, group: str) -> str:
    """Work stream of a consumer group (events/work.py): the events it must act on, deleted once acknowledged."""
    return _k(run_id, f"work:{group}")


def durable_probe_key(run_id: str) -> str:
    """Counter INCR'd by `EventLog.wait_durable` just before its WAITAOF, on the same connection: WAITAOF waits for
    the last write of the connection it runs on, and this write comes after every write acknowledged before it."""
    return _k(run_id, "durable")


def archive_key(run_id: str) -> str:
    """Hash: the manifest of the run's archived log segments (events/archive.py): directory, last archived id, one
    field per segment with its entry count and digest."""
    return _k(run_id, "archive")
