"""The state of a run, as typed dataclasses the reducer folds events into.

Groups (admitted -> generating -> complete | partial | cancelled -> scored -> consumed), samples, the weight-update
transaction per version, each rank's engine, admission, and the trainer. Snapshots serialise this state through
pydantic (`to_dict` / `from_dict`); `digest` is xxh3-128 over its canonical msgpack form, so two replays of one log
give the same digest exactly when they give the same state.

Bounded live state. `groups` holds the *live* groups only: a group leaves it (`retire_if_done`) once it is terminal
(consumed, dropped or cancelled) and nothing more is owed to it (no sample still running, no finished sample still
waiting for its score). What stays of it: a tombstone in `retired` (its id and terminal status, the newest
RETIRED_KEPT of them, so a late event for it is judged as before), the counters (`retired_groups`,
`admission.gone_before_training`, the trainer's), and its canonical record folded into `retired_digest`, a hash
chain in retirement order. So the state, its digest and a snapshot cost O(open work), not O(run), while the digest
still covers every group the run ever had. The archive (the log) keeps the groups themselves.

Closed weight updates leave `updates` the same way (workflows/reducer_update.retire_updates): a record stays while a
decider may read it (see there), the others leave a `RetiredUpdate` tombstone in `retired_updates` (the newest
UPDATE_TOMBSTONES_KEPT), and `updates_published` / `updates_aborted` count every transaction that ever closed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import msgpack
import xxhash
from pydantic import TypeAdapter

from rolledger.schemas.config import RunConfig
from rolledger.schemas.statuses import (
    AdmissionReason,
    EngineStatus,
    GroupStatus,
    LogprobMode,
    PolicyKind,
    RunStatus,
    SampleStatus,
    UpdateStatus,
    WakeTag,
)
from rolledger.schemas.trajectory import trajectory_nbytes

RETIRED_KEPT: Final = 1024  # tombstones of retired groups kept (the oldest is dropped first)
UPDATES_KEPT: Final = 8  # closed update records kept beside those a decider reads (reducer_update.retire_updates)
UPDATE_TOMBSTONES_KEPT: Final = 256  # tombstones of retired update records kept (the oldest is dropped first)
PROMPT_STATS_KEPT: Final = 4096  # prompts whose observed completion lengths the scheduler keeps (newest observed)

K = TypeVar("K")
V = TypeVar("V")


@dataclass(slots=True)
class SampleState:
    sample_id: str
    index: int
    status: SampleStatus
    rank: int
    policy_version: int
    weights_digest: str = ""
    tokens: int = 0
    nbytes: int = 0  # a finished sample's bytes while queued (SampleFinished.nbytes)
    reward: float | None = None
    correct: bool | None = None


@dataclass(slots=True)
class GroupState:
    group_id: str
    prompt_id: str
    n: int
    required: int
    policy_kind: PolicyKind
    admitted_event: str
    admitted_version: int
    est_remaining_tokens: int
    est_bytes: int
    prompt_tokens: int
    deadline: float | None = None
    admitted_at: float = 0.0  # wall time of its GroupAdmitted
    status: GroupStatus = GroupStatus.ADMITTED
    samples: dict[int, SampleState] = field(default_factory=dict)
    accepted: list[str] = field(default_factory=list)
    bytes: int = 0
    scored: int = 0
    versions: list[int] = field(default_factory=list)  # policy versions that produced its samples (sorted, unique)
    consumed_step: int | None = None

    @property
    def finished(self) -> int:
        return sum(1 for s in self.samples.values() if s.status == SampleStatus.FINISHED)

    @property
    def untrained(self) -> bool:
        """Admitted and neither consumed, dropped nor cancelled."""
        return self.status.is_untrained


@dataclass(slots=True)
class UpdateState:
    version: int
    base_version: int
    manifest_digest: str
    weights_digest: str
    uri: str
    bytes: int
    staged_event: str
    prepare_event: str = ""  # the PrepareRequested that opened the transaction (a rank's prepare answers it)
    status: UpdateStatus = UpdateStatus.STAGED
    ranks: list[int] = field(default_factory=list)
    fence: int = 0
    deadline: float = 0.0
    prepared: dict[int, str] = field(default_factory=dict)  # rank -> staged digest
    failed: dict[int, str] = field(default_factory=dict)  # rank -> reason
    committed: dict[int, str] = field(default_factory=dict)  # rank -> live weights digest after the swap
    invalidated: dict[int, int] = field(default_factory=dict)  # rank -> new cache generation
    healthy: list[int] = field(default_factory=list)
    probe_digests: dict[int, str] = field(default_factory=dict)  # rank -> digest of its health probe's output
    abort_reason: str = ""
    decided_event: str = ""
    paused_at: float = 0.0  # wall time of the AdmissionPaused(update) that started the drain
    paused_event: str = ""  # that AdmissionPaused's id (a rank's EnginePaused answers it)
    published_event: str = ""  # the PolicyPublished that closed it (a rank resuming answers it)
    committed_at: float = 0.0
    staged_at: float = 0.0  # wall time of its UpdateStaged
    quarantined: list[int] = field(default_factory=list)

    @property
    def all_prepared(self) -> bool:
        return bool(self.ranks) and all(r in self.prepared for r in self.ranks)

    @property
    def open(self) -> bool:
        """Neither aborted nor published: the transaction is still in flight."""
        return UpdateStatus(self.status).is_open

    @property
    def closing_event(self) -> str:
        """The command that closed the transaction: its PolicyPublished, else its UpdateAborted (or UpdateCommitted);
        "" while nothing has."""
        return self.published_event or self.decided_event


@dataclass(slots=True)
class RetiredUpdate:
    """What stays of a closed update record that left `updates`: its outcome (a late event for it is judged by it) and
    the event that closed it (what a rank discarding weights it staged for it answers)."""

    status: UpdateStatus
    closing_event: str


@dataclass(slots=True)
class RankState:
    rank: int
    engine: str
    status: EngineStatus = EngineStatus.AWAKE
    committed_version: int = 0
    weights_digest: str = ""
    cache_generation: int = 0
    graph_generation: int = 0
    sleep_level: int = 0
    woke: list[WakeTag] = field(default_factory=list)  # what an EngineWoke restored since the rank slept
    sleep_levels: list[int] = field(default_factory=list)
    logprob_mode: LogprobMode = LogprobMode.RAW
    groups_generated: int = 0
    drained_for: int = 0  # the update version whose drain this rank reported (EnginePaused); 0: none
    slept_in_handoff: int = -1  # admission.handoff_step of the handoff this rank last slept in; -1: never
    wake_on_abort: bool = False  # an update aborted while it slept: it wakes on the published weights
    abort_event: str = ""  # the UpdateAborted that set wake_on_abort (its wake answers it)
    quarantined_event: str = ""  # the last RankQuarantined of this rank (its rejoin answers it)
    quarantined_at: float = 0.0  # wall time of that RankQuarantined (the no-rank-in-service deadline runs from it)
    incarnation: str = ""  # the rank process whose RankJoined the log holds last ("" before incarnations existed)


@dataclass(slots=True)
class AdmissionState:
    paused: list[AdmissionReason] = field(default_factory=list)  # reasons currently holding admission closed
    queued_bytes: int = 0  # bytes of completed, untrained groups
    max_queued_bytes: int = 0  # high-water mark
    admitted: int = 0
    inflight: int = 0  # admitted and not yet complete/cancelled
    gone_before_training: int = 0  # admitted groups cancelled or dropped (the lag gate counts all the others)
    handoff_step: int = 0  # trainer step when the current (or last) colocated handoff began
    handoff_event: str = ""  # the AdmissionPaused(handoff) that began it (a rank's sleep answers it)
    # the pace the rate throttle follows (workflows/admission.py: throttle_cap), moving averages of wall times in the log
    gen_latency_s: float = 0.0  # a group's admission to its completion
    step_busy_s: float = 0.0  # a trainer step's busy time: training, then its update until published or aborted

    @property
    def open(self) -> bool:
        return not self.paused


@dataclass(slots=True)
class SchedulerState:
    """What the scheduler (workflows/scheduler.py) reads beyond the groups: where admission stands in the prompt
    sequence, and the completion lengths observed so far (its estimate, and that estimate's error)."""

    frontier: int = 0  # the lowest prompt index not admitted yet
    ahead: list[int] = field(default_factory=list)  # admitted prompt indices beyond the frontier, sorted (bounded by
    # the fairness bound plus one decision's admissions under srgf, empty under fifo)
    prompt_lengths: OrderedDict[str, list[int]] = field(default_factory=OrderedDict)  # prompt id -> [samples, tokens]
    bucket_lengths: dict[int, list[int]] = field(default_factory=dict)  # prompt-length bucket -> [samples, tokens]
    observed_samples: int = 0  # finished samples observed
    observed_tokens: int = 0  # their completion tokens
    est_abs_error: int = 0  # sum over them of |estimate their group was admitted with - tokens|
    est_signed_error: int = 0  # sum of (estimate - tokens)


@dataclass(slots=True)
class TrainerState:
    step: int = 0
    consumed_groups: int = 0
    consumed_trajectories: int = 0
    dropped_trajectories: int = 0
    lag_histogram: dict[int, int] = field(default_factory=dict)
    max_lag: int = 0
    rewards: list[float] = field(default_factory=list)  # reward mean per step
    logprob_gaps: list[float] = field(default_factory=list)  # median |gap| per step that had on-policy tokens
    refused: str = ""  # why the trainer refused a step (TrainStepRefused); non-empty: it trains no more
    last_train_s: float = 0.0  # the newest step's training time (TrainStepFinished.train_ms)


@dataclass(slots=True)
class Anomaly:
    event_id: str
    event_type: str
    message: str


@dataclass(slots=True)
class RunState:
    run_id: str = ""
    config: RunConfig | None = None
    status: RunStatus = RunStatus.PENDING
    started_event: str = ""  # the RunStarted id (a rank joining answers it)
    policy_version: int = 0  # the last published version
    weights_digest: str = ""
    groups: dict[str, GroupState] = field(default_factory=dict)  # the live ones (module docstring)
    retired: OrderedDict[str, GroupStatus] = field(default_factory=OrderedDict)  # the newest RETIRED_KEPT, oldest 1st
    retired_groups: int = 0  # groups that ever left the live state
    retired_digest: str = ""  # hash chain over the canonical record of each retired group, in retirement order
    after_retired: int = 0  # sample events for a retired group that raced its closure (counted, otherwise ignored)
    raced: dict[str, str] = field(default_factory=dict)  # sample id -> group id: started on a retired group, not ended
    updates: dict[int, UpdateState] = field(default_factory=dict)  # the open ones and the closed ones still read
    retired_updates: OrderedDict[int, RetiredUpdate] = field(default_factory=OrderedDict)  # newest, oldest first
    updates_published: int = 0  # update transactions ever closed by PolicyPublished ...
    updates_aborted: int = 0  # ... and by UpdateAborted (their records may have left `updates`)
    ranks: dict[int, RankState] = field(default_factory=dict)
    admission: AdmissionState = field(default_factory=AdmissionState)
    scheduler: SchedulerState = field(default_factory=SchedulerState)
    trainer: TrainerState = field(default_factory=TrainerState)
    workers_lost: dict[str, str] = field(default_factory=dict)  # WorkerLost: worker name -> its error
    # samples another rank closed as "worker lost" (it reclaimed their group): sample id -> the rank that started them
    reclaimed: dict[str, int] = field(default_factory=dict)
    late_results: int = 0  # events of that first rank for such samples after the reclaim: expected, counted, ignored
    reward_failures: int = 0  # finished samples the reward functions could not score (SampleFailed, stage "reward")
    reward_failures_in_a_row: int = 0  # since the last SampleScored; the run fails at task.max_consecutive_...
    last_reward_failure: str = ""  # "<sample id>: <reason>" of the newest
    anomalies: list[Anomaly] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # events applied, per type
    events_applied: int = 0
    last_event_id: str = ""
    # bounded, ordered window for duplicate detection. The bounded windows are OrderedDicts: the oldest leaves with
    # popitem(last=False) in O(1), where a dict's first key is found by scanning past every one deleted before it
    recent_ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    first_wall_time: float = 0.0
    last_wall_time: float = 0.0

    # ------------------------------------------------------------ derived views (pure)
    @property
    def open_update(self) -> UpdateState | None:
        """The newest update still in flight, if any."""
        for v in sorted(self.updates, reverse=True):
            if self.updates[v].open:
                return self.updates[v]
        return None

    @property
    def updates_committed(self) -> int:
        """Update transactions whose commit was decided: every published one, and an open one past its commit."""
        open_committed = sum(1 for u in self.updates.values() if u.open and UpdateStatus(u.status).is_decided_commit)
        return self.updates_published + open_committed

    @property
    def lag(self) -> int:
        """Current version minus the oldest version among untrained groups (0 when nothing is untrained). Untrained
        groups are live, so this scans the live groups only."""
        versions = [g.admitted_version for g in self.groups.values() if g.untrained]
        return self.policy_version - min(versions) if versions else 0

    def group_gone(self, group_id: str) -> GroupStatus | None:
        """The terminal status of a group that left the live state (None: live, or unknown/forgotten)."""
        return self.retired.get(group_id)

    def ready_groups(self) -> list[GroupState]:
        """Groups completed (and scored) but not yet consumed, oldest first."""
        return [g for g in self.groups.values() if g.status == GroupStatus.SCORED]

    def to_dict(self) -> dict[str, Any]:
        return _ADAPTER.dump_python(self, mode="json")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunState:
        state = _ADAPTER.validate_python(data)
        if "scheduler" not in data:  # a snapshot taken before the scheduler kept its own state (issue 14)
            _observe_groups(state)
        if "retired_groups" not in data:  # a snapshot taken before the live state was bounded (issue 12)
            _bound(state)
        if "updates_published" not in data:  # a snapshot taken before update records retired: every one is there
            state.updates_published = sum(1 for u in state.updates.values() if u.status == UpdateStatus.PUBLISHED)
            state.updates_aborted = sum(1 for u in state.updates.values() if u.status == UpdateStatus.ABORTED)
        _legacy_sample_bytes(state)
        return state

    def frozen(self) -> FrozenState:
        """A copy to snapshot on another thread (events.snapshots.SnapshotWriter): the plain dict, taken now, O(live
        state); its digest is computed from the copy, later, by whoever needs it."""
        return FrozenState(self.last_event_id, self.to_dict())

    def digest(self) -> str:
        """xxh3-128 of the canonical form, so any divergence shows: the live state in full, and every retired group
        through `retired_digest`. Its cost follows the live state, not the run. The window `retired` is left out of
        the hashed form: it is the newest N of an insertion sequence the digest already covers (each retirement's
        record, id and status included, is in the chain), so hashing it again would only add a cost that grows until
        it fills."""
        return digest_of(_ADAPTER.dump_python(self, mode="json", exclude=_NOT_HASHED))


def digest_of(data: dict[str, Any]) -> str:
    """RunState.digest of a state's `to_dict()` (the keys the digest leaves out are skipped)."""
    hashed = {k: v for k, v in data.items() if k not in _NOT_HASHED}
    return xxhash.xxh3_128_hexdigest(msgpack.packb(_canonical(hashed)))


@dataclass(frozen=True, slots=True)
class FrozenState:
    """A RunState as a plain dict, to snapshot off the decision thread (a SnapshotSource)."""

    last_event_id: str
    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def digest(self) -> str:
        return digest_of(self.data)


_TERMINAL_GROUP = frozenset({GroupStatus.CONSUMED, GroupStatus.DROPPED, GroupStatus.CANCELLED})


def owes_nothing(g: GroupState) -> bool:
    """A terminal group none of whose samples still runs or waits for its score: no event can change it any more
    except a late one (a result of a rank that lost it, a race with its closure)."""
    if g.status not in _TERMINAL_GROUP:
        return False
    for smp in g.samples.values():
        status = smp.status
        if status is _STARTED or (status is _FINISHED and smp.reward is None):
            return False
    return True


_STARTED = SampleStatus.STARTED  # module constants: an enum member read off its class is a Python-level lookup
_FINISHED = SampleStatus.FINISHED


def group_record(g: GroupState) -> list[Any]:
    """The canonical record of a group (every field, samples by index) that the retired-groups hash chain covers."""
    return [
        g.group_id,
        g.prompt_id,
        g.n,
        g.required,
        str(g.policy_kind),
        g.admitted_event,
        g.admitted_version,
        g.est_remaining_tokens,
        g.est_bytes,
        g.prompt_tokens,
        g.deadline,
        g.admitted_at,
        str(g.status),
        [
            [
                s.sample_id,
                s.index,
                str(s.status),
                s.rank,
                s.policy_version,
                s.weights_digest,
                s.tokens,
                s.nbytes,
                s.reward,
                s.correct,
            ]
            for _, s in sorted(g.samples.items())
        ],
        g.accepted,
        g.bytes,
        g.scored,
        g.versions,
        g.consumed_step,
    ]


def _legacy_sample_bytes(state: RunState) -> None:
    """A snapshot taken before samples counted their encoded size holds no `nbytes` for its finished samples (a real
    one is never 0): they count what that log counted (`trajectory_nbytes`), so their groups complete as recorded."""
    for g in state.groups.values():
        for smp in g.samples.values():
            if smp.status is SampleStatus.FINISHED and smp.nbytes == 0:
                smp.nbytes = trajectory_nbytes(g.prompt_tokens, smp.tokens)


def _observe_groups(state: RunState) -> None:
    """The scheduler state of a snapshot from before issue 14, from what it holds: admission was by count, so the
    frontier is the count admitted; the completion lengths are those of the groups it kept (every group, in a
    snapshot from before issue 12; the live ones only, after it: the estimate then starts from fewer observations)."""
    from rolledger.workflows.scheduler import observe_completion  # the scheduler builds on this module

    state.scheduler.frontier = state.admission.admitted
    for g in state.groups.values():
        for smp in sorted(g.samples.values(), key=lambda s: s.index):
            if smp.status is SampleStatus.FINISHED or (smp.status is SampleStatus.FAILED and smp.tokens):
                observe_completion(state.scheduler, g, smp.tokens)


def _bound(state: RunState) -> None:
    """Bring a state restored from an older snapshot (every group kept) to the bounded form: the counters the deciders
    read instead of scanning every group, then every group that owes nothing retired (in the snapshot's group order,
    so its retired-groups chain is not the one a replay from the start gives: the old snapshot's digest differs
    anyway, the digest's definition having changed with it)."""
    groups = list(state.groups.values())
    state.admission.gone_before_training = sum(1 for g in groups if g.status in _GONE_BEFORE_TRAINING)
    for g in groups:
        retire_if_done(state, g)


_GONE_BEFORE_TRAINING = frozenset({GroupStatus.CANCELLED, GroupStatus.DROPPED})


def keep_newest(window: OrderedDict[K, V], key: K, value: V, kept: int) -> None:
    """Add to a bounded tombstone window (oldest first): past `kept` entries the oldest leaves, in O(1)."""
    window[key] = value
    if len(window) > kept:
        window.popitem(last=False)


def retire_if_done(state: RunState, g: GroupState) -> None:
    """Move a group that owes nothing out of the live state: a tombstone, the counters, the hash chain."""
    if not owes_nothing(g) or state.groups.get(g.group_id) is not g:
        return
    del state.groups[g.group_id]
    keep_newest(state.retired, g.group_id, g.status, RETIRED_KEPT)
    state.retired_groups += 1
    state.retired_digest = xxhash.xxh3_128_hexdigest(_packer.pack([state.retired_digest, group_record(g)]))


_packer = msgpack.Packer(use_bin_type=True)  # what msgpack.packb(..., use_bin_type=True) builds on every call


def _canonical(obj: Any) -> Any:
    if isinstance(obj, dict):
        return [[str(k), _canonical(v)] for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))]
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    return obj


_ADAPTER: TypeAdapter[RunState] = TypeAdapter(RunState)
_NOT_HASHED = {"retired"}  # see RunState.digest


def group_version(g: GroupState) -> int:
    """The oldest policy version that produced the group's tokens (its admission version before any finished)."""
    return min(g.versions or [g.admitted_version])


def group_lag(state: RunState, g: GroupState) -> int:
    """How many versions the published policy is ahead of the group's tokens (the trainer drops it past max_lag)."""
    return state.policy_version - group_version(g)
