"""The event envelope and every event payload, as msgspec records (schemas.base.Record) named by their class: one
concept, the catalogue of the log's vocabulary, kept whole (see the last paragraph for why).

Event names are the contract of ../shared/DESIGN.md; payloads are ours. Each payload type has a `schema_version`;
an older version on the wire is upcast (see UPCASTERS) before validation, a newer one is refused.

Conventions: group ids `g000017`; sample/trajectory ids `g000017/3` (group id, slash, index in the group); ranks are
0-based ints; `fence` is the leader-lease fencing token of the coordinator that took a decision; wall times are unix
seconds (float); `*_ms` are durations. These are the models only: an envelope is stamped with a fresh id and the wall
clock by `rolledger.events.envelope.make_event`, at the edge that produces it.

Each payload is a frozen, positional msgspec Struct: built in a fraction of a microsecond, encoded and decoded by
msgspec in C (events/codec.py), its fields' types and `Meta` bounds validated wherever one is decoded. Its `type`
is its class name (a class attribute: the entry's frame carries it, not the payload's fields).

Why one module over 400 lines: it is one concept, the catalogue of the log's vocabulary (36 small records and the
upcasters of older versions); read top to bottom it is the list of events in lifecycle order, and split by family
it would need every family imported back to build the one union the codec validates against.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from types import UnionType
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin, get_type_hints

import msgspec
from msgspec import Meta

from rolledger.schemas.base import I32, Int32Array, Record, packed
from rolledger.schemas.config import PartialPolicy, RunConfig, SamplingParams
from rolledger.schemas.statuses import (
    AdmissionReason,
    CacheKind,
    DrainMode,
    DropReason,
    GroupOutcome,
    LogprobMode,
    PreparePhase,
    RunStatus,
    WakeTag,
)
from rolledger.schemas.trajectory import Trajectory

NonNegative = Annotated[int, Meta(ge=0)]
_force = msgspec.structs.force_setattr


class Payload(Record, frozen=True, kw_only=True):
    """Base of every event payload; `type` is the class's name, SCHEMA_VERSION the current version of the type."""

    SCHEMA_VERSION: ClassVar[int] = 1
    type: ClassVar[str] = "Payload"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.type = cls.__name__

    def __post_init__(self) -> None:
        # a status given as its string ("failed") becomes the StrEnum member (msgspec decodes members already; a
        # record built in code may be given the string): one type check per enum field, none for most payloads
        cls = type(self)
        fields = _ENUM_FIELDS.get(cls)
        if fields is None:
            fields = _ENUM_FIELDS[cls] = _enum_fields(cls)
        for name, enum, many in fields:
            value = getattr(self, name)
            try:
                if many:
                    if any(type(v) is not enum for v in value):
                        _force(self, name, tuple(enum(v) for v in value))
                elif value is not None and type(value) is not enum:
                    _force(self, name, enum(value))
            except ValueError:
                raise ValueError(f"{name}: {value!r} is not one of {[m.value for m in enum]}") from None


_ENUM_FIELDS: dict[type, tuple[tuple[str, type[StrEnum], bool], ...]] = {}


def _is_enum(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, StrEnum)


def _enum_fields(cls: type) -> tuple[tuple[str, type[StrEnum], bool], ...]:
    """(field, StrEnum, a tuple of them?) of each field of `cls` annotated with a StrEnum, an optional one, or a
    tuple of them."""
    out: list[tuple[str, type[StrEnum], bool]] = []
    for name, hint in get_type_hints(cls).items():
        if name not in cls.__struct_fields__:  # type: ignore[attr-defined]
            continue
        origin, args = get_origin(hint), get_args(hint)
        if _is_enum(hint):
            out.append((name, hint, False))
        elif origin in (Union, UnionType) and any(_is_enum(a) for a in args):
            out.append((name, next(a for a in args if _is_enum(a)), False))
        elif origin is tuple and args and _is_enum(args[0]):
            out.append((name, args[0], True))
    return tuple(out)


# ---------------------------------------------------------------- run
TERMINAL_RUN_STATUSES = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.ABORTED, RunStatus.CANCELLED})


class RunStarted(Payload, frozen=True, kw_only=True):
    config: RunConfig
    initial_weights_digest: str
    model_dir: str = ""


class RunFinished(Payload, frozen=True, kw_only=True):
    status: RunStatus  # a terminal one (TERMINAL_RUN_STATUSES)
    reason: str = ""
    steps: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.status not in TERMINAL_RUN_STATUSES:
            raise ValueError(f"status: {self.status.value!r} is not a terminal run status")


# ---------------------------------------------------------------- admission
class GroupAdmitted(Payload, frozen=True, kw_only=True):
    """A prompt admitted as a group of n samples; the command the rollout workers consume."""

    SCHEMA_VERSION: ClassVar[int] = 2  # v2 added `prompt_index`
    group_id: str
    prompt_id: str
    prompt_index: NonNegative | None = (
        None  # the prompt's position in the run's prompt sequence (None: before issue 14)
    )
    prompt_token_ids: I32
    n: Annotated[int, Meta(ge=1)]
    sampling: SamplingParams
    partial_policy: PartialPolicy
    answer: str  # ground truth for the reward checker
    est_remaining_tokens: NonNegative  # the scheduler's estimate (n x per-sample estimate), never ground truth
    est_bytes: NonNegative
    queued_bytes: NonNegative  # completed-but-untrained bytes at the moment of admission
    byte_cap: NonNegative
    deadline: float | None = None  # wall time after which the group is cut per its policy

    def __post_init__(self) -> None:
        if type(self.prompt_token_ids) is not Int32Array:
            _force(self, "prompt_token_ids", packed(Int32Array, self.prompt_token_ids, "prompt_token_ids"))


class AdmissionPaused(Payload, frozen=True, kw_only=True):
    reason: AdmissionReason
    queued_bytes: int = 0
    lag: int = 0
    detail: str = ""


class AdmissionResumed(Payload, frozen=True, kw_only=True):
    reason: AdmissionReason


# ---------------------------------------------------------------- rollout
class SampleStarted(Payload, frozen=True, kw_only=True):
    sample_id: str
    group_id: str
    index: int
    rank: int
    policy_version: int
    weights_digest: str


class SampleFinished(Payload, frozen=True, kw_only=True):
    """A sample ended and can be trained on. v2: its trajectory may carry an episode's turns (`Trajectory.turns`:
    when each turn of the policy and of the environment began and ended, and its tokens); a v1 entry has none."""

    SCHEMA_VERSION: ClassVar[int] = 2  # v2 added `trajectory.turns`
    trajectory: Trajectory
    answer: str = ""  # the group's ground truth, carried so the reward worker stays stateless
    gen_ms: float = 0.0
    # the trajectory's encoded size, what its group holds while queued (schemas/wire.encoded_size); None in a log
    # written before it was recorded (then schemas/trajectory.trajectory_nbytes counts)
    nbytes: NonNegative | None = None


class SampleFailed(Payload, frozen=True, kw_only=True):
    """A sample that cannot be trained on. `stage`: "rollout" (its engine failed, or its rank lost the group),
    "env" (its episode's environment raised, hung past its timeout or answered something that is not a reply; the
    error names the environment and the turn), or "reward" (it finished but its reward functions could not score
    it; `rank` is the rank that generated it)."""

    SCHEMA_VERSION: ClassVar[int] = 2  # v2 added the stage "env"
    sample_id: str
    group_id: str
    index: int
    rank: int
    error: str
    stage: Literal["rollout", "env", "reward"] = "rollout"


class SampleCancelled(Payload, frozen=True, kw_only=True):
    SCHEMA_VERSION: ClassVar[int] = 2  # v2 added `tokens`
    sample_id: str
    group_id: str
    index: int
    reason: str
    tokens: NonNegative = 0  # tokens it had generated when cut short: the work the cancel wasted


class GroupCompleted(Payload, frozen=True, kw_only=True):
    """The group satisfied its partial policy; `accepted` are the samples the trainer may use."""

    group_id: str
    accepted: tuple[str, ...]
    status: GroupOutcome
    bytes: NonNegative


class GroupCancelled(Payload, frozen=True, kw_only=True):
    group_id: str
    reason: str


# ---------------------------------------------------------------- reward
class SampleScored(Payload, frozen=True, kw_only=True):
    SCHEMA_VERSION: ClassVar[int] = 2  # v2 added `correct`
    sample_id: str
    group_id: str
    reward: float
    correct: bool


# ---------------------------------------------------------------- trainer
class BatchConsumed(Payload, frozen=True, kw_only=True):
    step: int
    group_ids: tuple[str, ...]
    versions: tuple[int, ...]  # policy version of each consumed group
    lags: tuple[int, ...]  # trainer version minus group version, per group
    trajectory_ids: tuple[str, ...]
    bytes: int = 0


class TrajectoryDropped(Payload, frozen=True, kw_only=True):
    """A completed group refused at consumption (over the lag cap); counted, never silently lost."""

    group_id: str
    trajectory_ids: tuple[str, ...]
    reason: DropReason
    lag: int = 0


class TrainStepFinished(Payload, frozen=True, kw_only=True):
    """`logprob_gap_*`: |trainer - engine| logprob over the tokens the engine generated with the very weights the
    trainer held (`agreement_tokens` of them; 0 when the batch had none, and then the gaps are 0)."""

    step: int
    loss: float
    reward_mean: float
    logprob_gap_median: float
    logprob_gap_p99: float
    agreement_tokens: int = 0
    max_seq_ratio: float
    clipped_frac: float
    train_ms: float = 0.0
    is_truncated_frac: float = 0.0  # tokens whose importance weight hit trainer.is_cap (truncated IS)


# ---------------------------------------------------------------- weight update
class UpdateStaged(Payload, frozen=True, kw_only=True):
    version: int
    base_version: int
    manifest_digest: str
    weights_digest: str
    uri: str
    bytes: int
    tensors: int
    # the weights this version was trained from (manifest.parent_digest): the audit checks the trainer's lineage
    parent_weights_digest: str | None = None


class PrepareRequested(Payload, frozen=True, kw_only=True):
    """The coordinator's command to every participating rank: prepare `version` by `deadline`.

    Self-contained: it carries where the update is staged and what it must verify to, so a rank prepares from the
    command alone. v2 added `uri`, `weights_digest` and `bytes`; a v1 event upcasts with them empty,
    and readers fall back to the version's UpdateStaged record.
    """

    SCHEMA_VERSION: ClassVar[int] = 2
    version: int
    manifest_digest: str
    ranks: tuple[int, ...]
    deadline: float
    fence: int
    uri: str = ""
    weights_digest: str = ""  # the digest every rank must report after committing
    bytes: int = 0


class RankPrepared(Payload, frozen=True, kw_only=True):
    version: int
    rank: int
    manifest_digest: str
    staged_digest: str
    prepare_ms: float = 0.0


class RankPrepareFailed(Payload, frozen=True, kw_only=True):
    version: int
    rank: int
    phase: PreparePhase
    tensor: str | None = None
    reason: str


class UpdateCommitted(Payload, frozen=True, kw_only=True):
    """The decision to swap `version` in on `ranks`. v2 added `weights_digest` (what each rank must then hold);
    a v1 event upcasts with it empty, and readers fall back to the version's UpdateStaged record."""

    SCHEMA_VERSION: ClassVar[int] = 2
    version: int
    manifest_digest: str
    ranks: tuple[int, ...]
    fence: int
    weights_digest: str = ""


class UpdateAborted(Payload, frozen=True, kw_only=True):
    version: int
    reason: str
    failed_ranks: tuple[int, ...] = ()
    fence: int


class RankCommitted(Payload, frozen=True, kw_only=True):
    version: int
    rank: int
    weights_digest: str
    commit_ms: float = 0.0


class CacheInvalidated(Payload, frozen=True, kw_only=True):
    rank: int
    kind: CacheKind
    generation: int
    version: int


class HealthPassed(Payload, frozen=True, kw_only=True):
    """A rank's probe on the committed weights passed. v2 added the speculative decoder's acceptance (the share of
    the draft's tokens the target model accepted) where the engine runs a draft, None elsewhere:
    `spec_acceptance_rate` over the probe on the new weights, `spec_acceptance_before` over what the rank served
    between its previous probe and this commit (workflows/health.py fails the probe on a drop past
    `update.max_spec_acceptance_drop`)."""

    SCHEMA_VERSION: ClassVar[int] = 2
    rank: int
    version: int
    weights_digest: str
    probe_digest: str = ""
    spec_acceptance_rate: Annotated[float, Meta(ge=0, le=1)] | None = None
    spec_acceptance_before: Annotated[float, Meta(ge=0, le=1)] | None = None


class HealthFailed(Payload, frozen=True, kw_only=True):
    rank: int
    version: int
    reason: str


class PolicyPublished(Payload, frozen=True, kw_only=True):
    version: int
    weights_digest: str
    ranks: tuple[int, ...]
    fence: int


# ---------------------------------------------------------------- engine
class EngineSlept(Payload, frozen=True, kw_only=True):
    rank: int
    level: Literal[1, 2]
    bytes_freed: int
    verified: bool


class EngineWoke(Payload, frozen=True, kw_only=True):
    rank: int
    tags: tuple[WakeTag, ...]
    bytes_restored: int = 0


class EnginePaused(Payload, frozen=True, kw_only=True):
    rank: int
    mode: DrainMode


class EngineResumed(Payload, frozen=True, kw_only=True):
    rank: int


class RankJoined(Payload, frozen=True, kw_only=True):
    rank: int
    engine: str
    policy_version: int
    weights_digest: str
    sleep_levels: tuple[int, ...] = ()
    logprob_mode: LogprobMode = LogprobMode.RAW
    incarnation: str = ""  # the rank process (RankWorker) that announced itself; "" in older logs


class RankQuarantined(Payload, frozen=True, kw_only=True):
    rank: int
    version: int
    reason: str


class CommandRefused(Payload, frozen=True, kw_only=True):
    """An illegal order refused by a rank or coordinator (an update while asleep, a resume before health, ...)."""

    command: str
    reason: str
    rank: int | None = None


# ---------------------------------------------------------------- facts the coordinator decides on
class TrainStepRefused(Payload, frozen=True, kw_only=True):
    """The trainer measured its logprob gap over the on-policy tokens of the planned step and did not train on it
    (the weights the engine reported did not arrive). A fact: the coordinator decides the run's end from it."""

    step: int
    version: int  # the version the trainer's weights are (the one the gap was measured against)
    reason: str
    gap_median: float
    gap_p99: float = 0.0
    agreement_tokens: int = 0


class WorkerLost(Payload, frozen=True, kw_only=True):
    """A worker crashed and nothing restarts it (written by the driver that watched it die). A fact: the coordinator
    decides the run's end from it."""

    worker: str
    kind: str = ""
    error: str = ""


PAYLOAD_TYPES: dict[str, type[Payload]] = {cls.type: cls for cls in Payload.__subclasses__()}


class AppendMark(Record, frozen=True, kw_only=True):
    """Which append of which log writer wrote an entry, and what that writer knew was already in the log.

    Every `EventLog` (events/store.py) is a writer with a random `origin`; it numbers its appends 1, 2, 3, ... (`n`)
    and stamps the first event of each with this mark, together with `acked`: the highest of its own appends that
    Redis had acknowledged when this one was encoded (0: none yet). An acknowledged append is in the log unless the
    log lost it, so a mark whose `acked` append is not in the log proves a loss of acknowledged events (an
    uncoordinated failover to a replica that lagged, a restore from an older copy): workflows/log_marks.py finds it
    and the audit names it. Numbers a writer used for an append that was refused or never answered are simply
    absent, which proves nothing."""

    origin: Annotated[int, Meta(ge=0)]  # the writer: random per EventLog instance (32 bits)
    n: Annotated[int, Meta(ge=1)]  # the writer's append number, from 1
    acked: NonNegative  # the writer's highest append acknowledged before this one (0: none), always < n

    def __post_init__(self) -> None:
        if self.acked >= self.n:
            raise ValueError(f"acked: {self.acked} is not below the append's own number {self.n}")


class Event(Record, frozen=True, kw_only=True):
    """The envelope: identity, causality and the policy version in force, around one payload. `event_id` is unique
    and sortable (a ULID); `policy_version` is the version in force when the event was produced.

    `append` is where this copy of the event came from, not part of the event: the mark of the log writer's append
    that wrote it (AppendMark; on the first event of each append, None on the others and on events not read from
    a log, or read from one written before issue 41). Two events are equal when everything but it is."""

    event_id: str
    schema_version: Annotated[int, Meta(ge=1)]
    run_id: str
    producer: str
    causation_id: str | None = None
    correlation_id: str | None = None
    policy_version: NonNegative
    wall_time: float
    payload: Payload
    append: AppendMark | None = None

    @property
    def type(self) -> str:
        return self.payload.type

    def _key(self) -> tuple[Any, ...]:
        return (
            self.event_id,
            self.schema_version,
            self.run_id,
            self.producer,
            self.causation_id,
            self.correlation_id,
            self.policy_version,
            self.wall_time,
            self.payload,
        )

    def __eq__(self, other: object) -> bool:
        if type(other) is not Event:
            return NotImplemented
        return self._key() == other._key()

    def __ne__(self, other: object) -> bool:
        if type(other) is not Event:
            return NotImplemented
        return self._key() != other._key()

    def __hash__(self) -> int:
        return hash(self._key())


# ---------------------------------------------------------------- upcasting
# (type, from_version) -> function turning that version's payload dict into the next version's.
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
UPCASTERS: dict[tuple[str, int], Upcaster] = {
    ("SampleScored", 1): lambda p: {**p, "correct": float(p.get("reward", 0.0)) >= 1.0},
    ("PrepareRequested", 1): lambda p: {**p, "uri": "", "weights_digest": "", "bytes": 0},
    ("UpdateCommitted", 1): lambda p: {**p, "weights_digest": ""},
    ("GroupAdmitted", 1): lambda p: {**p, "prompt_index": None},
    ("SampleCancelled", 1): lambda p: {**p, "tokens": 0},
    ("SampleFinished", 1): lambda p: p,  # a v1 trajectory has no turns: the field's default, ()
    ("SampleFailed", 1): lambda p: p,  # v1 knew the stages "rollout" and "reward" only
    ("HealthPassed", 1): lambda p: p,  # v1 measured no acceptance: the fields' default, None
}


class SchemaTooNew(ValueError):
    """The event was written by a newer rolledger than this one."""


def current_version(type_: str, version: int) -> int:
    """The current SCHEMA_VERSION of `type_`, which an entry of `version` can be read as; ValueError for an unknown
    type, SchemaTooNew for a version newer than this rolledger's."""
    cls = PAYLOAD_TYPES.get(type_)
    if cls is None:
        raise ValueError(f"unknown event type {type_!r}")
    if version > cls.SCHEMA_VERSION:
        raise SchemaTooNew(f"{type_} schema v{version} is newer than this rolledger's v{cls.SCHEMA_VERSION}")
    return cls.SCHEMA_VERSION


def upcast(type_: str, version: int, payload: dict[str, Any]) -> dict[str, Any]:
    """Bring a payload dict of `version` up to the current SCHEMA_VERSION of its type."""
    current = current_version(type_, version)
    while version < current:
        step = UPCASTERS.get((type_, version))
        if step is None:
            raise ValueError(f"no upcaster for {type_} v{version}")
        payload = step(payload)
        version += 1
    return payload
