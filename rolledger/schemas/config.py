"""The run configuration: sampling settings, group and partial policy, scheduler, admission caps, trainer, updates,
task (its prompts, rewards and environment), engines. Over 500 lines as one concept: the declared run, section by
section, every field with its bounds and its description, the reference a config file is written against; split by
section, a reader would need every module to see what one run declares.

Loaded from TOML/JSON/YAML or built in code; unknown or invalid fields raise a ValidationError naming the field.
Numbers are numbers: a bool is refused where an int or float is declared (`steps = true` is not 1), and so are
infinities and NaN (`ConfigModel`). `RunConfig.load` turns every problem with a file (missing, unparsable, YAML
without pyyaml, an invalid field) into one `ConfigError` line naming the file and the field.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from rolledger.schemas.base import Model
from rolledger.schemas.statuses import LogprobMode, PolicyKind


class ConfigError(ValueError):
    """A config that cannot be used, in one line naming the file (if any) and the field."""


def _admits_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_admits_bool(a) for a in typing.get_args(annotation))
    return False


def _is_number(annotation: Any) -> bool:
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_is_number(a) for a in typing.get_args(annotation))
    return False


class ConfigModel(Model):
    """A config section: no bool where a number is declared, no inf or nan."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            if _is_number(annotation) and not _admits_bool(annotation):
                raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
        return value


def one_line(exc: ValidationError, source: str | None = None, model: type[BaseModel] | None = None) -> str:
    """A ValidationError as one line: `source: field.path: message` (the first error, and how many more).

    With the `model` that was validated, an unknown field gets a hint naming the closest valid one
    (`trainer.warm_start_step: unknown field; did you mean warm_start_steps?`), and so does a value outside a
    field's choices (`engine: Input should be 'torch' or 'vllm' (got 'vlm'); did you mean 'vllm'?`).
    """
    errors = exc.errors()
    first = errors[0]
    loc = tuple(first["loc"])
    where = ".".join(str(p) for p in loc) or "(top level)"
    msg = first["msg"]
    hint = ""
    if first["type"] == "extra_forbidden":
        msg = "unknown field"
        suggestion = suggest_field(model, loc) if model is not None else None
        hint = f"; did you mean {suggestion}?" if suggestion else ""
    elif first["type"] in ("literal_error", "enum") and isinstance(first.get("input"), str):
        given = first["input"]
        msg = f"{msg} (got {given!r})"
        allowed = re.findall(r"'([^']*)'", str((first.get("ctx") or {}).get("expected", "")))
        close = difflib.get_close_matches(given, allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
    elif isinstance(first.get("input"), int | float) and not isinstance(first.get("input"), bool):
        msg = f"{msg} (got {first['input']!r})"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{source + ': ' if source else ''}{where}: {msg}{hint}{more}"


def _sections(model: type[BaseModel], prefix: str = "") -> dict[str, type[BaseModel]]:
    """Every (nested) model section of `model` by its dotted path ("" for the model itself)."""
    found: dict[str, type[BaseModel]] = {prefix: model}
    for name, info in model.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            found.update(_sections(sub, f"{prefix}{name}."))
    return found


def suggest_field(model: type[BaseModel], loc: tuple[int | str, ...]) -> str | None:
    """The valid field closest to the unknown one at `loc`: a close spelling in the same section (its name), else
    the same name in another section (its dotted path, e.g. `trainer.warm_start_steps` for a top-level
    `warm_start_steps`); None when nothing is close."""
    if not loc:
        return None
    sections = _sections(model)
    parent = "".join(f"{p}." for p in loc[:-1])
    name = str(loc[-1])
    here = sections.get(parent)
    if here is not None:
        close = difflib.get_close_matches(name, list(here.model_fields), n=1)
        if close:
            return close[0]
    elsewhere = [f"{path}{f}" for path, section in sections.items() for f in section.model_fields if path != parent]
    leaf = {p: p.rsplit(".", 1)[-1] for p in elsewhere}
    exact = [p for p, f in leaf.items() if f == name]
    if exact:
        return exact[0]
    close = difflib.get_close_matches(name, list(leaf.values()), n=1, cutoff=0.8)
    return next((p for p, f in leaf.items() if close and f == close[0]), None)


class SamplingParams(ConfigModel):
    """What the engine is asked to sample with; stamped on every trajectory."""

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    max_tokens: int = Field(4, ge=1, description="an answer is at most two digits and <eos>")
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprob_mode: LogprobMode = LogprobMode.RAW


class PartialPolicy(ConfigModel):
    """When a group counts as finished: all N, at least k of N, or the first k with the rest cancelled.

    `deadline_s`: a group still short of its policy at the deadline is cancelled (or completed as partial when
    at least k samples finished under `at_least`).
    """

    kind: PolicyKind = PolicyKind.ALL
    k: int | None = Field(None, ge=1)
    deadline_s: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _k_needed(self) -> PartialPolicy:
        if self.kind is not PolicyKind.ALL and self.k is None:
            raise ValueError(f"partial_policy.k is required when kind={self.kind.value!r}")
        return self

    def required(self, n: int) -> int:
        """How many finished samples make the group complete."""
        return n if self.kind is PolicyKind.ALL or self.k is None else min(self.k, n)


class AdmissionConfig(ConfigModel):
    """Caps on completed-but-untrained work, and the throttle to the trainer's drain rate."""

    max_queued_bytes: int = Field(4 * 1024 * 1024, gt=0, description="cap on bytes of completed, untrained groups")
    max_lag: int = Field(1, ge=0, description="cap on policy versions between the current one and the oldest untrained")
    max_inflight_groups: int = Field(8, ge=1, description="groups admitted but not yet completed")
    max_wait_rounds: int = Field(
        2,
        ge=0,
        description="srgf fairness: a prompt overtaken by this many rounds of trainer.groups_per_step later prompts "
        "is admitted next (0: fifo order)",
    )
    throttle_to_drain_rate: bool = True


class TrainerConfig(ConfigModel):
    lr: float = Field(1e-4, gt=0)
    groups_per_step: int = Field(8, ge=1)
    clip_eps: float = Field(0.2, gt=0)
    warm_start_steps: int = Field(
        400, ge=0, description="supervised steps run before RL (a tiny model learns little from scratch)"
    )
    warm_start_lr: float = Field(1e-3, gt=0)
    importance: Literal["none", "truncated"] = Field(
        "truncated",
        description="off-policy correction: 'truncated' clips the PPO ratio against the trainer's own weights before "
        "the step and weights each token by min(trainer / engine probability, is_cap) (decoupled PPO with truncated "
        "importance sampling: a lagged token still moves the policy); 'none' clips against the engine's logprobs",
    )
    is_cap: float = Field(2.0, gt=1.0, description="truncated importance sampling: the cap on a token's weight")
    checkpoint_every: int = Field(
        1,
        ge=0,
        description="the built-in trainer saves its optimizer state with every Nth staged version (0: never); the "
        "weights are staged with every version, so a restarted trainer resumes both from the version it holds",
    )
    max_logprob_gap: float = Field(
        1e-3,
        gt=0,
        description="median |trainer - engine| logprob on on-policy tokens above which the weights did not arrive: "
        "the trainer halts the run instead of training (float32 engines agree to ~1e-7; raise it for bf16 engines)",
    )
    overlap_update: bool = Field(
        False,
        description="disaggregated only: plan and train step s+1 while the update of step s is still open (staged "
        "but not published), recording it once that update closes; the trainer no longer idles through each update, "
        "but its weights are then never the serving ones when it plans, so the agreement gate measures nothing "
        "(no sample is on-policy) and lags are counted against the open version",
    )


class UpdateConfig(ConfigModel):
    """The weight-update transaction."""

    drain_mode: Literal["abort", "wait", "keep"] = "wait"  # the values of statuses.DrainMode, the engines' PauseMode
    prepare_deadline_s: float = Field(30.0, gt=0)
    drain_deadline_s: float = Field(30.0, gt=0)
    commit_deadline_s: float = Field(30.0, gt=0)
    max_consecutive_aborts: int = Field(
        3, ge=1, description="this many updates aborted in a row (none published between) fail the run, naming them"
    )
    max_spec_acceptance_drop: float = Field(
        0.5,
        gt=0,
        le=1,
        description="where an engine runs a speculative draft: the health probe fails when the draft's acceptance "
        "on the new weights is below (1 - this) x its acceptance before the commit (a draft the new policy no longer "
        "matches); 1 never fails",
    )
    staging_dir: Path | None = Field(
        None, description="defaults to runs/<run-id>/staging; under the dist transport it is the trainer's own"
    )
    staging_fsync: bool = Field(
        False,
        description="fsync each staged version before announcing it; off by default, like the log's AOF (appendfsync "
        "no): a host crash can lose either, and a torn or missing version fails its checksums, so the update aborts",
    )
    transport: Literal["directory", "dist"] = Field(
        "directory",
        description="how staged versions reach the ranks: 'directory' (a filesystem trainer and ranks share) or "
        "'dist' (the trainer serves them over torch.distributed/gloo; nothing shared but the network)",
    )
    transport_host: str = Field(
        "127.0.0.1", min_length=1, description="dist: the address the trainer's weight server listens on and announces"
    )
    transport_port: int = Field(
        0, ge=0, le=65535, description="dist: its port; 0 picks a free one when the run starts, kept for the run"
    )
    transport_delta: bool = Field(
        False,
        description="dist: send a rank the XOR of the new version with the one it serves, zstd-compressed, checked "
        "against the full tensors' checksums after applying (a rank whose base differs gets the full version)",
    )
    transport_bucket_mb: float = Field(64.0, gt=0, le=4096, description="dist: bytes sent per message, in MiB")
    transport_backend: Literal["gloo", "nccl"] = Field(
        "gloo",
        description="dist: the torch.distributed backend the bytes go over: 'gloo' (host memory, any machine) or "
        "'nccl' (through a CUDA buffer on the trainer and on each rank; untested where no GPU was lent)",
    )
    allow_remote_transport: bool = Field(
        False, description="dist: allow a transport_host outside loopback and private networks (unauthenticated)"
    )

    @model_validator(mode="after")
    def _backend_needs_dist(self) -> UpdateConfig:
        if self.transport_backend != "gloo" and self.transport != "dist":
            raise ValueError(
                f"update.transport_backend={self.transport_backend!r} needs update.transport='dist' "
                f"(got {self.transport!r})"
            )
        return self


class RecoveryConfig(ConfigModel):
    """Liveness of in-flight work: how often a rank refreshes its claim on the groups it generates (the heartbeat),
    how long a claim may go unrefreshed before another consumer reclaims the work, and how long a run may go with no
    rank in service before it fails."""

    heartbeat_s: float = Field(1.0, gt=0, allow_inf_nan=False, description="a rank refreshes its claims this often")
    lost_after_s: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        description="work whose claim was not refreshed for this long is reclaimed by another consumer (missed beats)",
    )
    no_rank_in_service_s: float = Field(
        120.0, gt=0, allow_inf_nan=False, description="the run fails when no rank has been in service this long"
    )

    @model_validator(mode="after")
    def _beats_fit(self) -> RecoveryConfig:
        if self.heartbeat_s * 2 > self.lost_after_s:
            raise ValueError(
                f"recovery.heartbeat_s={self.heartbeat_s:g} must be at most half of lost_after_s={self.lost_after_s:g}"
            )
        return self

    @property
    def lost_after_ms(self) -> int:
        return int(self.lost_after_s * 1000)


class LogConfig(ConfigModel):
    """Archive, then trim (events/archive.py): the run log's old entries move to segment files in the run directory
    (`<run dir>/archive/`) and the Redis stream keeps a live window, so Redis memory is bounded by the window, not the
    run. Trimming never passes a consumer group's undelivered or pending entries or the latest reducer snapshot."""

    archive: bool = Field(True, description="archive the log into segment files and trim the live stream behind them")
    keep_live: int = Field(
        10_000,
        ge=1,
        description="entries always left in the live stream (tailing readers; never empty, so a resumed run "
        "sees its log)",
    )
    archive_every: int = Field(
        10_000, ge=1, description="a segment is written once this many entries beyond keep_live wait (its length)"
    )


class ModelConfig(ConfigModel):
    """The tiny policy the project builds itself when the run has no checkpoint (no hub): a Qwen2 or Llama causal LM.
    A run on an existing checkpoint (`--model-dir`) takes the architecture and sizes from its config.json."""

    architecture: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(256, ge=8)
    num_hidden_layers: int = Field(2, ge=1)
    num_attention_heads: int = Field(2, ge=1)
    num_key_value_heads: int = Field(1, ge=1)
    max_position_embeddings: int = Field(64, ge=8)
    dtype: Literal["float32", "bfloat16"] = "float32"


REWARD_FN_PATTERN = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class RewardSpec(ConfigModel):
    """One reward function by import path (`module:function`) and its weight in the sum. The function is called
    TRL-style: `fn(completions: list[str], prompts=[...], <column>=[...], ...) -> list[float]`, one float per
    completion; it is imported when the run starts (workers/policy/rewards.py), never when a config is read."""

    fn: str = Field(pattern=REWARD_FN_PATTERN.pattern, description="'module:function'")
    weight: float = 1.0


class TaskConfig(ConfigModel):
    """Where prompts come from (`kind`: the built-in addition task, a JSONL file, or a Hugging Face `datasets`
    dataset on local files) and how completions are rewarded (`rewards`; the addition task's checker by default).
    The prompt plug-ins are workers/policy/task_plugins.py."""

    kind: Literal["addition", "jsonl", "dataset"] = "addition"
    max_operand: int = Field(49, ge=1, description="addition: operands are in [0, max_operand]")
    num_prompts: int = Field(
        64,
        ge=1,
        description="addition: a small pool: each prompt recurs, so reward tracks the policy, not prompt difficulty",
    )
    path: str | None = Field(
        None,
        description="jsonl: the file, one JSON object per line; dataset: what datasets.load_dataset is given first "
        "(a local directory or file, or a builder such as 'json', 'csv', 'parquet' with data_files)",
    )
    data_files: str | tuple[str, ...] | None = Field(None, description="dataset: load_dataset's data_files")
    split: str = Field("train", min_length=1, description="dataset: the split to read")
    prompt_field: str = Field("prompt", min_length=1, description="jsonl/dataset: the column holding the prompt text")
    answer_field: str = Field(
        "answer", min_length=1, description="jsonl/dataset: the column holding the answer ('' when a row has none)"
    )
    id_field: str | None = Field(
        None, description="jsonl/dataset: a column holding a stable prompt id; default '<kind>-<row number>'"
    )
    rewards: tuple[RewardSpec, ...] = Field(
        (), description="reward functions summed by weight; empty: the addition checker (addition only)"
    )
    max_consecutive_reward_failures: int = Field(
        64, ge=1, description="the run fails once this many samples in a row could not be scored"
    )
    env: str | None = Field(
        None,
        pattern=REWARD_FN_PATTERN.pattern,
        description="'module:function': the task's environment (schemas/episode.py); each sample is then an episode "
        "of turns: the policy generates, `step(history) -> EnvReply` answers, its tokens are appended (never trained "
        "on) and the policy continues, until the environment is done or a limit below is reached",
    )
    max_turns: int = Field(
        4, ge=1, le=256, description="env: the most policy turns an episode runs (the environment answers each)"
    )
    max_episode_tokens: int = Field(
        64,
        ge=1,
        description="env: the most tokens an episode's completion holds, the policy's and the environment's together "
        "(each policy turn also at most sampling.max_tokens); admission reserves bytes and a rank KV cache for it",
    )
    env_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="env: a step that takes longer fails its sample (stage 'env')"
    )
    env_workers: int = Field(
        4, ge=1, le=256, description="env: the processes a rank runs environment steps in (one step each at a time)"
    )

    @property
    def episodes(self) -> bool:
        """The task declares an environment: every sample is an episode of turns."""
        return self.env is not None

    @model_validator(mode="after")
    def _source_given(self) -> TaskConfig:
        if self.kind != "addition" and self.path is None:
            raise ValueError(f"task.path is required when task.kind={self.kind!r}")
        if self.kind != "addition" and not self.rewards:
            raise ValueError(f"task.rewards must name at least one reward function when task.kind={self.kind!r}")
        return self


class SimulatedConfig(ConfigModel):
    """engine = "simulated" only: a benchmark engine whose tokens cost declared time, not a model's compute
    (workers/engines/simulated_engine.py). Every time below is multiplied by `time_scale`."""

    step_s: float = Field(0.045, gt=0, description="one decode step: every sequence in flight on a rank gains a token")
    prefill_s_per_token: float = Field(0.0002, ge=0, description="prefill time per prompt token, once per group")
    time_scale: float = Field(
        1.0, gt=0, le=1, description="multiplies every declared time (0.02: a 45 ms step in 0.9 ms)"
    )
    length_median: float = Field(200.0, gt=0, description="median sample length in tokens (capped at max_tokens)")
    length_sigma: float = Field(1.0, ge=0, le=4, description="lognormal sigma of a sample's length around its prompt's")
    prompt_sigma: float = Field(
        0.0, ge=0, le=4, description="lognormal sigma of a prompt's median around length_median (its own difficulty)"
    )
    lengths: tuple[int, ...] = Field(
        (), description="lengths given per sample: sample i of every group has lengths[i % len]; overrides the above"
    )
    kv_cache_tokens: int = Field(0, ge=0, description="the KV cache a rank reports, in tokens (0: none reported)")
    max_num_seqs: int = Field(
        0,
        ge=0,
        description="the most sequences a rank's engine decodes at once (vLLM's max_num_seqs): the others wait, "
        "first come first served, and join the batch as sequences end (0: unbounded, every sequence decodes)",
    )

    @field_validator("lengths")
    @classmethod
    def _positive(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(x < 1 for x in value):
            raise ValueError(f"every length must be >= 1 (got {min(value)})")
        return value


class TorchEngineConfig(ConfigModel):
    """Where and how the built-in torch engine (`engine = "torch"`) runs its ranks."""

    process: bool = Field(
        False,
        description="each rank's engine runs in a process of its own (workers/engines/engine_process): its Python "
        "decode loop no longer shares the rank worker's interpreter, so the worker's control-plane work runs beside "
        "the decode instead of inside its steps (bench/bench_rollout.py --engine-process)",
    )
    max_batch_groups: int = Field(
        0,
        ge=0,
        le=256,
        description="the most groups one decode step batches (0: every group the rank's slots send); below "
        "rank_slots, the other groups wait in the engine and join the step after one ends, so the batch stays full "
        "while a slot logs its finished group and takes the next",
    )


class RunConfig(ConfigModel):
    """Everything a run declares up front; recorded in RunStarted so a replay knows the rules it ran under."""

    seed: int = 0
    steps: int = Field(40, ge=1, description="trainer steps (policy versions produced)")
    engine: Literal["torch", "vllm", "sglang", "simulated"] = "torch"  # simulated: benchmarks only
    ranks: int = Field(1, ge=1)
    rank_slots: int = Field(1, ge=1, le=256, description="groups one rank generates at once (its rollout slots)")
    kv_cache_cap: float = Field(
        0.9,
        gt=0,
        le=1,
        description="a rank starts a group only while the worst case of its groups (n x (prompt + max_tokens) "
        "tokens each) fits in this fraction of the KV cache its engine reports (vLLM, SGLang, simulated)",
    )
    rank_capacity: Literal["groups", "sequences"] = Field(
        "groups",
        description="what a rank counts to take more work (workflows.rank.may_take): 'groups', a rank runs up to "
        "rank_slots groups, each holding its slot until its last sample ends; 'sequences', a rank takes another "
        "group (up to rank_slots in flight) while the sequences still generating on it and the new group's fit in "
        "rank_max_seqs and their worst case in its KV budget, so a straggler holds one sequence, not a group's slot "
        "(continuous batching, as vLLM's max_num_seqs)",
    )
    rank_max_seqs: int = Field(
        0,
        ge=0,
        description="rank_capacity = 'sequences': the sequences a rank's engine runs at once (vLLM's max_num_seqs); "
        "0: the simulated engine's simulated.max_num_seqs, for other engines unbounded (only rank_slots and the KV "
        "budget bound it)",
    )
    mode: Literal["colocated", "disaggregated"] = "disaggregated"
    group_size: int = Field(8, ge=1, description="N samples per prompt")
    partial_policy: PartialPolicy = PartialPolicy()
    scheduler: Literal["fifo", "srgf", "youngest-cancel"] = Field(
        "fifo",
        description="admission order (workflows/scheduler.py): by prompt index, or shortest estimated first; "
        "youngest-cancel admits by prompt index and, when the untrained groups outnumber the rate throttle's cap, "
        "cancels the youngest open ones down to it (prime-rl's overload policy; needs "
        "admission.throttle_to_drain_rate)",
    )
    interruptible: bool = False
    recycle_aborted: bool = Field(
        False,
        description="a sample an update's `abort` drain cuts short keeps its tokens: "
        "its rank continues it from them once it serves again, and its spans say which version produced which "
        "tokens (as an interruptible run's do); off: the cut samples are cancelled and their group replaced",
    )
    sleep_level: Literal[1, 2] = 1
    sampling: SamplingParams = SamplingParams()
    admission: AdmissionConfig = AdmissionConfig()
    trainer: TrainerConfig = TrainerConfig()
    update: UpdateConfig = UpdateConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    log: LogConfig = LogConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    simulated: SimulatedConfig = SimulatedConfig()
    torch_engine: TorchEngineConfig = TorchEngineConfig()
    join_deadline_s: float = Field(600.0, gt=0, description="every rank must have joined this long after RunStarted")
    run_deadline_s: float = Field(1800.0, gt=0, description="the coordinator aborts the run this long after RunStarted")
    vllm_urls: tuple[str, ...] = ()
    sglang_urls: tuple[str, ...] = Field(
        (), description="running SGLang servers, one per rank, started from the run's model directory"
    )
    allow_remote_engines: bool = Field(False, description="drive unauthenticated RL routes on non-private addresses")

    @model_validator(mode="after")
    def _partial_fits_group(self) -> RunConfig:
        k = self.partial_policy.k
        if k is not None and k > self.group_size:
            raise ValueError(f"partial_policy.k={k} exceeds group_size={self.group_size}")
        if self.scheduler == "youngest-cancel" and not self.admission.throttle_to_drain_rate:
            raise ValueError(
                "scheduler = 'youngest-cancel' needs admission.throttle_to_drain_rate (its overload is the "
                "throttle's cap)"
            )
        seqs = self.rank_max_seqs or (self.simulated.max_num_seqs if self.engine == "simulated" else 0)
        if self.rank_capacity == "sequences" and 0 < seqs < self.group_size:
            raise ValueError(
                f"rank_capacity = 'sequences' with {seqs} sequences a rank (rank_max_seqs, else simulated.max_num_seqs)"
                f" is below group_size={self.group_size}: no group would fit"
            )
        if self.task.env is not None and self.task.max_episode_tokens < self.sampling.max_tokens:
            raise ValueError(
                f"task.max_episode_tokens={self.task.max_episode_tokens} is below sampling.max_tokens="
                f"{self.sampling.max_tokens}: an episode's first turn alone may take more"
            )
        if self.trainer.overlap_update and self.mode != "disaggregated":
            raise ValueError(
                "trainer.overlap_update needs mode = 'disaggregated' (colocated, the trainer has the "
                "devices only while every engine sleeps)"
            )
        return self

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        """Read a TOML, JSON or YAML file; every error is one ConfigError line naming the file and the field."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(f"{p}: cannot read the config file: {exc.strerror or exc}") from None
        try:
            if p.suffix == ".toml":
                import tomllib

                data: Any = tomllib.loads(text)
            elif p.suffix in (".yaml", ".yml"):
                try:
                    import yaml
                except ImportError:
                    raise ConfigError(f"{p}: YAML needs pyyaml (pip install pyyaml), or use TOML/JSON") from None
                data = yaml.safe_load(text) or {}
            elif p.suffix == ".json":
                import json

                data = json.loads(text)
            else:
                raise ConfigError(f"{p}: unknown config format {p.suffix!r} (use .toml, .json, .yaml or .yml)")
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - tomllib, json and yaml raise their own types for a bad file
            detail = " ".join(str(exc).split())
            raise ConfigError(f"{p}: not valid {p.suffix.lstrip('.').upper()}: {detail}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the config must be a table/object of fields, not {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(one_line(exc, str(p), cls)) from None
