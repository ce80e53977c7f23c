"""The event envelope and every event payload, as one pydantic discriminated union on `type`.

Event names are the contract of ../shared/DESIGN.md; payloads are ours. Each payload type has a `schema_version`;
an older version on the wire is upcast (see UPCASTERS) before validation, a newer one is refused.

Conventions: group ids `g000017`; sample/trajectory ids `g000017/3` (group id, slash, index in the group); ranks are
0-based ints; `fence` is the leader-lease fencing token of the coordinator that took a decision; wall times are unix
seconds (float); `*_ms` are durations. These are the models only: an envelope is stamped with a fresh id and the wall
clock by `rolledger.events.envelope.make_event`, at the edge that produces it.

Why one module over 400 lines: it is the catalogue of the log's vocabulary (36 small models, the union and the
upcasters of older versions); read top to bottom it is the list of events in lifecycle order, and split by family
it would need every family imported back to build the one union the codec validates against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, TypeAdapter

from rolledger.schemas.base import I32Array, Model
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


class Payload(Model):
    """Base of every event payload; `type` is the discriminator, SCHEMA_VERSION the current version of the type."""

    SCHEMA_VERSION: ClassVar[int] = 1
    type: str


# ---------------------------------------------------------------- run
class RunStarted(Payload):
    type: Literal["RunStarted"] = "RunStarted"
    config: RunConfig
    initial_weights_digest: str
    model_dir: str = ""


class RunFinished(Payload):
    type: Literal["RunFinished"] = "RunFinished"
    status: Literal[RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.ABORTED, RunStatus.CANCELLED]  # the terminal ones
    reason: str = ""
    steps: int = 0


# ---------------------------------------------------------------- admission
class GroupAdmitted(Payload):
    """A prompt admitted as a group of n samples; the command the rollout workers consume."""

    SCHEMA_VERSION: ClassVar[int] = 2  # v2 added `prompt_index`
    type: Literal["GroupAdmitted"] = "GroupAdmitted"
    group_id: str
    prompt_id: str
    prompt_index: int | None = Field(
        None, ge=0, description="the prompt's position in the run's prompt sequence (None: a log from before issue 14)"
    )
    prompt_token_ids: I32Array
    n: int = Field(ge=1)
    sampling: SamplingParams
    partial_policy: PartialPolicy
    answer: str = Field(description="ground truth for the reward checker")
    est_remaining_tokens: int = Field(
        ge=0, description="the scheduler's estimate of the group's tokens (n x per-sample estimate), never ground truth"
    )
    est_bytes: int = Field(ge=0)
    queued_bytes: int = Field(ge=0, description="completed-but-untrained bytes at the moment of admission")
    byte_cap: int = Field(ge=0)
    deadline: float | None = Field(None, description="wall time after which the group is cut per its policy")


class AdmissionPaused(Payload):
    type: Literal["AdmissionPaused"] = "AdmissionPaused"
    reason: AdmissionReason
    queued_bytes: int = 0
    lag: int = 0
    detail: str = ""


class AdmissionResumed(Payload):
    type: Literal["AdmissionResumed"] = "AdmissionResumed"
    reason: AdmissionReason


# ---------------------------------------------------------------- rollout
class SampleStarted(Payload):
    type: Literal["SampleStarted"] = "SampleStarted"
    sample_id: str
    group_id: str
    index: int
    rank: int
    policy_version: int
    weights_digest: str


class SampleFinished(Payload):
    type: Literal["SampleFinished"] = "SampleFinished"
    trajectory: Trajectory
    answer: str = Field("", description="the group's ground truth, carried so the reward worker stays stateless")
    gen_ms: float = 0.0
    nbytes: int | None = Field(
        None,
        ge=0,
        description="the trajectory's encoded size, what its group holds while queued (schemas/wire.encoded_size); "
        "None in a log written before it was recorded (then schemas/trajectory.trajectory_nbytes counts)",
    )


class SampleFailed(Payload):
    """A sample that cannot be trained on. `stage`: "rollout" (its engine failed, or its rank lost the group), or
    "reward" (it finished but its reward functions could not score it; `rank` is the rank that generated it)."""

    type: Literal["SampleFailed"] = "SampleFailed"
    sample_id: str
    group_id: str
    index: int
    rank: int
    error: str
    stage: Literal["rollout", "reward"] = "rollout"


class SampleCancelled(Payload):
    SCHEMA_VERSION: ClassVar[int] = 2  # v2 added `tokens`
    type: Literal["SampleCancelled"] = "SampleCancelled"
    sample_id: str
    group_id: str
    index: int
    reason: str
    tokens: int = Field(0, ge=0, description="tokens it had generated when cut short: the work the cancel wasted")


class GroupCompleted(Payload):
    """The group satisfied its partial policy; `accepted` are the samples the trainer may use."""

    type: Literal["GroupCompleted"] = "GroupCompleted"
    group_id: str
    accepted: tuple[str, ...]
    status: GroupOutcome
    bytes: int = Field(ge=0)


class GroupCancelled(Payload):
    type: Literal["GroupCancelled"] = "GroupCancelled"
    group_id: str
    reason: str


# ---------------------------------------------------------------- reward
class SampleScored(Payload):
    SCHEMA_VERSION: ClassVar[int] = 2  # v2 added `correct`
    type: Literal["SampleScored"] = "SampleScored"
    sample_id: str
    group_id: str
    reward: float
    correct: bool


# ---------------------------------------------------------------- trainer
class BatchConsumed(Payload):
    type: Literal["BatchConsumed"] = "BatchConsumed"
    step: int
    group_ids: tuple[str, ...]
    versions: tuple[int, ...] = Field(description="policy version of each consumed group")
    lags: tuple[int, ...] = Field(description="trainer version minus group version, per group")
    trajectory_ids: tuple[str, ...]
    bytes: int = 0


class TrajectoryDropped(Payload):
    """A completed group refused at consumption (over the lag cap); counted, never silently lost."""

    type: Literal["TrajectoryDropped"] = "TrajectoryDropped"
    group_id: str
    trajectory_ids: tuple[str, ...]
    reason: DropReason
    lag: int = 0


class TrainStepFinished(Payload):
    """`logprob_gap_*`: |trainer - engine| logprob over the tokens the engine generated with the very weights the
    trainer held (`agreement_tokens` of them; 0 when the batch had none, and then the gaps are 0)."""

    type: Literal["TrainStepFinished"] = "TrainStepFinished"
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
class UpdateStaged(Payload):
    type: Literal["UpdateStaged"] = "UpdateStaged"
    version: int
    base_version: int
    manifest_digest: str
    weights_digest: str
    uri: str
    bytes: int
    tensors: int
    # the weights this version was trained from (manifest.parent_digest): the audit checks the trainer's lineage
    parent_weights_digest: str | None = None


class PrepareRequested(Payload):
    """The coordinator's command to every participating rank: prepare `version` by `deadline`.

    Self-contained: it carries where the update is staged and what it must verify to, so a rank prepares from the
    command alone. v2 added `uri`, `weights_digest` and `bytes`; a v1 event upcasts with them empty,
    and readers fall back to the version's UpdateStaged record.
    """

    SCHEMA_VERSION: ClassVar[int] = 2
    type: Literal["PrepareRequested"] = "PrepareRequested"
    version: int
    manifest_digest: str
    ranks: tuple[int, ...]
    deadline: float
    fence: int
    uri: str = ""
    weights_digest: str = Field("", description="the digest every rank must report after committing")
    bytes: int = 0


class RankPrepared(Payload):
    type: Literal["RankPrepared"] = "RankPrepared"
    version: int
    rank: int
    manifest_digest: str
    staged_digest: str
    prepare_ms: float = 0.0


class RankPrepareFailed(Payload):
    type: Literal["RankPrepareFailed"] = "RankPrepareFailed"
    version: int
    rank: int
    phase: PreparePhase
    tensor: str | None = None
    reason: str


class UpdateCommitted(Payload):
    """The decision to swap `version` in on `ranks`. v2 added `weights_digest` (what each rank must then hold);
    a v1 event upcasts with it empty, and readers fall back to the version's UpdateStaged record."""

    SCHEMA_VERSION: ClassVar[int] = 2
    type: Literal["UpdateCommitted"] = "UpdateCommitted"
    version: int
    manifest_digest: str
    ranks: tuple[int, ...]
    fence: int
    weights_digest: str = ""


class UpdateAborted(Payload):
    type: Literal["UpdateAborted"] = "UpdateAborted"
    version: int
    reason: str
    failed_ranks: tuple[int, ...] = ()
    fence: int


class RankCommitted(Payload):
    type: Literal["RankCommitted"] = "RankCommitted"
    version: int
    rank: int
    weights_digest: str
    commit_ms: float = 0.0


class CacheInvalidated(Payload):
    type: Literal["CacheInvalidated"] = "CacheInvalidated"
    rank: int
    kind: CacheKind
    generation: int
    version: int


class HealthPassed(Payload):
    type: Literal["HealthPassed"] = "HealthPassed"
    rank: int
    version: int
    weights_digest: str
    probe_digest: str = ""


class HealthFailed(Payload):
    type: Literal["HealthFailed"] = "HealthFailed"
    rank: int
    version: int
    reason: str


class PolicyPublished(Payload):
    type: Literal["PolicyPublished"] = "PolicyPublished"
    version: int
    weights_digest: str
    ranks: tuple[int, ...]
    fence: int


# ---------------------------------------------------------------- engine
class EngineSlept(Payload):
    type: Literal["EngineSlept"] = "EngineSlept"
    rank: int
    level: Literal[1, 2]
    bytes_freed: int
    verified: bool


class EngineWoke(Payload):
    type: Literal["EngineWoke"] = "EngineWoke"
    rank: int
    tags: tuple[WakeTag, ...]
    bytes_restored: int = 0


class EnginePaused(Payload):
    type: Literal["EnginePaused"] = "EnginePaused"
    rank: int
    mode: DrainMode


class EngineResumed(Payload):
    type: Literal["EngineResumed"] = "EngineResumed"
    rank: int


class RankJoined(Payload):
    type: Literal["RankJoined"] = "RankJoined"
    rank: int
    engine: str
    policy_version: int
    weights_digest: str
    sleep_levels: tuple[int, ...] = ()
    logprob_mode: LogprobMode = LogprobMode.RAW
    incarnation: str = ""  # the rank process (RankWorker) that announced itself; "" in older logs


class RankQuarantined(Payload):
    type: Literal["RankQuarantined"] = "RankQuarantined"
    rank: int
    version: int
    reason: str


class CommandRefused(Payload):
    """An illegal order refused by a rank or coordinator (an update while asleep, a resume before health, ...)."""

    type: Literal["CommandRefused"] = "CommandRefused"
    command: str
    reason: str
    rank: int | None = None


# ---------------------------------------------------------------- facts the coordinator decides on
class TrainStepRefused(Payload):
    """The trainer measured its logprob gap over the on-policy tokens of the planned step and did not train on it
    (the weights the engine reported did not arrive). A fact: the coordinator decides the run's end from it."""

    type: Literal["TrainStepRefused"] = "TrainStepRefused"
    step: int
    version: int = Field(description="the version the trainer's weights are (the one the gap was measured against)")
    reason: str
    gap_median: float
    gap_p99: float = 0.0
    agreement_tokens: int = 0


class WorkerLost(Payload):
    """A worker crashed and nothing restarts it (written by the driver that watched it die). A fact: the coordinator
    decides the run's end from it."""

    type: Literal["WorkerLost"] = "WorkerLost"
    worker: str
    kind: str = ""
    error: str = ""


AnyPayload = Annotated[
    RunStarted
    | RunFinished
    | GroupAdmitted
    | AdmissionPaused
    | AdmissionResumed
    | SampleStarted
    | SampleFinished
    | SampleFailed
    | SampleCancelled
    | GroupCompleted
    | GroupCancelled
    | SampleScored
    | BatchConsumed
    | TrajectoryDropped
    | TrainStepFinished
    | UpdateStaged
    | PrepareRequested
    | RankPrepared
    | RankPrepareFailed
    | UpdateCommitted
    | UpdateAborted
    | RankCommitted
    | CacheInvalidated
    | HealthPassed
    | HealthFailed
    | PolicyPublished
    | EngineSlept
    | EngineWoke
    | EnginePaused
    | EngineResumed
    | RankJoined
    | RankQuarantined
    | CommandRefused
    | TrainStepRefused
    | WorkerLost,
    Field(discriminator="type"),
]

PAYLOAD_TYPES: dict[str, type[Payload]] = {cls.model_fields["type"].default: cls for cls in Payload.__subclasses__()}


class Event(Model):
    """The envelope: identity, causality and the policy version in force, around one payload."""

    event_id: str = Field(description="unique and sortable (ULID)")
    schema_version: int = Field(ge=1)
    run_id: str
    producer: str
    causation_id: str | None = None
    correlation_id: str | None = None
    policy_version: int = Field(ge=0, description="policy version in force when the event was produced")
    wall_time: float
    payload: AnyPayload

    @property
    def type(self) -> str:
        return self.payload.type


EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


# ---------------------------------------------------------------- upcasting
# (type, from_version) -> function turning that version's payload dict into the next version's.
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
UPCASTERS: dict[tuple[str, int], Upcaster] = {
    ("SampleScored", 1): lambda p: {**p, "correct": float(p.get("reward", 0.0)) >= 1.0},
    ("PrepareRequested", 1): lambda p: {**p, "uri": "", "weights_digest": "", "bytes": 0},
    ("UpdateCommitted", 1): lambda p: {**p, "weights_digest": ""},
    ("GroupAdmitted", 1): lambda p: {**p, "prompt_index": None},
    ("SampleCancelled", 1): lambda p: {**p, "tokens": 0},
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
