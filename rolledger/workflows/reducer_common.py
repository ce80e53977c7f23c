"""What the reducer's event families share: recording an anomaly, and finding the group, update or rank an event
names (an unknown one is an anomaly)."""

from __future__ import annotations

from rolledger.schemas import events as ev
from rolledger.workflows.state import Anomaly, GroupState, RankState, RunState, UpdateState


def anomaly(state: RunState, event: ev.Event, message: str) -> None:
    state.anomalies.append(Anomaly(event.event_id, event.type, message))


def find_group(s: RunState, e: ev.Event, group_id: str) -> GroupState | None:
    """The live group; None (an anomaly) for a group that is unknown or already left the live state."""
    g = s.groups.get(group_id)
    if g is None:
        gone = s.retired.get(group_id)
        anomaly(s, e, f"unknown group {group_id}" if gone is None else f"group {group_id} already {gone} and retired")
    return g


def find_update(s: RunState, e: ev.Event, version: int) -> UpdateState | None:
    """The update's record; None (an anomaly) for a version never staged, or one whose record retired (an event for
    it now is late: workflows/reducer_update.retire_updates)."""
    u = s.updates.get(version)
    if u is None:
        gone = s.retired_updates.get(version)
        anomaly(s, e, f"unknown update version {version}" if gone is None else f"v{version} already {gone.status}")
    return u


def find_rank(s: RunState, e: ev.Event, rank: int) -> RankState | None:
    r = s.ranks.get(rank)
    if r is None:
        anomaly(s, e, f"unknown rank {rank}")
    return r


def sample_index(sample_id: str) -> int:
    """The index in its group of a sample id `g000017/3`."""
    return int(sample_id.rsplit("/", 1)[1])


def moving_average(old: float, sample: float, weight: float = 0.25) -> float:
    """An exponentially weighted moving average; the first sample (old == 0) is taken as it is."""
    return sample if old == 0.0 else old + weight * (sample - old)
