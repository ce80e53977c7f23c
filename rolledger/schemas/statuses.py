"""The closed sets of statuses and reasons that events carry and the reducer's state holds.

Each is a `StrEnum`: a member equals its string value (so logs written before these existed read the same), and the
membership questions that code asks are named predicates here, never tuples repeated at the call sites.
"""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"  # kept for old logs: a run stopped from outside (deadline, cancel)
    CANCELLED = "cancelled"  # stopped by its operator (SIGTERM/SIGINT of `rolledger run`)

    @property
    def is_terminal(self) -> bool:
        return self in _RUN_TERMINAL


_RUN_TERMINAL = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.ABORTED, RunStatus.CANCELLED})


class GroupStatus(StrEnum):
    ADMITTED = "admitted"
    GENERATING = "generating"
    COMPLETE = "complete"
    PARTIAL = "partial"
    CANCELLED = "cancelled"
    SCORED = "scored"
    CONSUMED = "consumed"
    DROPPED = "dropped"

    @property
    def is_open(self) -> bool:
        """Still generating or waiting to: samples may start, finish or be cancelled."""
        return self in _GROUP_OPEN

    @property
    def is_untrained(self) -> bool:
        """Admitted and neither consumed, dropped nor cancelled: it may still reach the trainer."""
        return self not in _GROUP_GONE

    @property
    def is_terminal(self) -> bool:
        """Nothing more can happen to it: consumed, dropped or cancelled."""
        return self in _GROUP_GONE

    @property
    def is_completed(self) -> bool:
        """Completed (all or part of it) and waiting for its scores."""
        return self in _GROUP_COMPLETED

    @property
    def is_queued(self) -> bool:
        """Completed and not yet trained, dropped or cancelled: its bytes count against the admission cap."""
        return self in _GROUP_QUEUED


_GROUP_OPEN = frozenset({GroupStatus.ADMITTED, GroupStatus.GENERATING})
_GROUP_GONE = frozenset({GroupStatus.CONSUMED, GroupStatus.DROPPED, GroupStatus.CANCELLED})
_GROUP_COMPLETED = frozenset({GroupStatus.COMPLETE, GroupStatus.PARTIAL})
_GROUP_QUEUED = _GROUP_COMPLETED | {GroupStatus.SCORED}


class SampleStatus(StrEnum):
    STARTED = "started"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self is not SampleStatus.STARTED


class UpdateStatus(StrEnum):
    STAGED = "staged"
    PREPARING = "preparing"
    COMMITTED = "committed"
    ABORTED = "aborted"
    INVALIDATED = "invalidated"
    HEALTHY = "healthy"
    PUBLISHED = "published"

    @property
    def is_open(self) -> bool:
        """Neither aborted nor published: the transaction is still in flight."""
        return self not in _UPDATE_CLOSED

    @property
    def is_decided_commit(self) -> bool:
        """The commit is decided (it stands: a rank that missed it rolls forward to it)."""
        return self in _UPDATE_COMMITTED

    @property
    def is_undecided(self) -> bool:
        """Staged or preparing: neither committed nor aborted yet."""
        return self in _UPDATE_UNDECIDED

    @property
    def is_swappable(self) -> bool:
        """Committed and not yet published: ranks may swap it in, invalidate and pass health."""
        return self in _UPDATE_SWAPPABLE


_UPDATE_UNDECIDED = frozenset({UpdateStatus.STAGED, UpdateStatus.PREPARING})
_UPDATE_SWAPPABLE = frozenset({UpdateStatus.COMMITTED, UpdateStatus.INVALIDATED, UpdateStatus.HEALTHY})
_UPDATE_CLOSED = frozenset({UpdateStatus.ABORTED, UpdateStatus.PUBLISHED})
_UPDATE_COMMITTED = frozenset(
    {UpdateStatus.COMMITTED, UpdateStatus.INVALIDATED, UpdateStatus.HEALTHY, UpdateStatus.PUBLISHED}
)


class EngineStatus(StrEnum):
    AWAKE = "awake"
    PAUSED = "paused"
    ASLEEP = "asleep"
    QUARANTINED = "quarantined"

    @property
    def may_serve(self) -> bool:
        return self is EngineStatus.AWAKE

    @property
    def in_service(self) -> bool:
        """Joined and not quarantined: the rank takes part in updates and generation."""
        return self is not EngineStatus.QUARANTINED

    @property
    def is_stopped(self) -> bool:
        """Paused or asleep: not generating, so an update may swap its weights."""
        return self in _ENGINE_STOPPED


_ENGINE_STOPPED = frozenset({EngineStatus.PAUSED, EngineStatus.ASLEEP})


class AdmissionReason(StrEnum):
    """Why admission is paused (AdmissionPaused / AdmissionResumed)."""

    BYTES = "bytes"
    LAG = "lag"
    UPDATE = "update"
    HANDOFF = "handoff"
    MANUAL = "manual"
    RATE = "rate"


class DrainMode(StrEnum):
    """What an engine does with in-flight generation when it pauses for an update."""

    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"


class PreparePhase(StrEnum):
    """The step of a rank's update that failed (RankPrepareFailed)."""

    PREPARE = "prepare"
    TRANSFER = "transfer"
    COMMIT = "commit"


class CacheKind(StrEnum):
    """What a CacheInvalidated bumped: a content cache (prefix, kv, encoder) or the compiled graphs."""

    PREFIX = "prefix"
    KV = "kv"
    GRAPH = "graph"
    ENCODER = "encoder"

    @property
    def is_graph(self) -> bool:
        """Bumps the rank's graph generation (every other kind bumps its cache generation)."""
        return self is CacheKind.GRAPH

    @property
    def is_token_cache(self) -> bool:
        """A prefix or kv cache: the generation a trajectory's `cache_generation` stamps."""
        return self in _TOKEN_CACHES


_TOKEN_CACHES = frozenset({CacheKind.PREFIX, CacheKind.KV})


class DropReason(StrEnum):
    """Why a completed group was refused at consumption (TrajectoryDropped)."""

    LAG = "lag"
    MIXED_VERSIONS = "mixed_versions"
    QUARANTINED_RANK = "quarantined_rank"


class GroupOutcome(StrEnum):
    """How a group completed (GroupCompleted): every sample, or as many as its partial policy required."""

    COMPLETE = "complete"
    PARTIAL = "partial"


class WakeTag(StrEnum):
    """What an EngineWoke restored; an engine is awake again once both are."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"


class LogprobMode(StrEnum):
    """Which logprobs an engine reports: of the raw model distribution, or after sampling processors."""

    RAW = "raw"
    PROCESSED = "processed"


class PolicyKind(StrEnum):
    """The partial policy of a group: all N samples, at least k, or the first k with the rest cancelled."""

    ALL = "all"
    AT_LEAST = "at_least"
    FIRST_K = "first_k"
