"""A training loop's seat in a run: the trainer-side client API (public as `rolledger.client`).

Any Python training loop sits under rolledger's control plane through it, without subclassing a worker; the built-in
GRPO trainer (workers/roles/trainer.py) is one such loop. The decisions stay in `workflows.trainer` (which groups make the
next batch, which are dropped for lag, which version is staged next, the agreement gate, the lineage rule); this
client only follows the log, carries them out and appends their facts:

- `TrainerClient.connect(redis_url, run_id)`: follows the run's log (its RunStarted gives the config and the model
  directory) and opens the trainer's staging store for the run's transport.
- `restore()`: the weights the log says this trainer holds (its last staged version, read back from its own copy), so
  a restarted loop continues from them; None at v0 (the run's model directory is the start).
- `next_batch(weights)`: blocks until the run's partial policy and lag cap give a batch, checks that `weights`
  descend from the log (the lineage rule: the trainer's last staged version or the published one), and returns the
  trajectories with their full provenance and rewards; the groups over the lag cap are dropped with their reason.
  None when the run has no more steps for a trainer (finished, last step taken, or a refused step).
- `agreement(batch, logprobs)`: the trainer's own logprobs of the generated tokens of the on-policy trajectories (in
  each trajectory's logprob mode; `token_logprobs` computes them for a Hugging Face causal LM) against the engine's;
  the gate is the same for every trainer. A refused step appends `TrainStepRefused` and raises `StepRefused`.
- `publish(batch, weights, stats)`: stages the new weights with their manifest (and the digest of what they were
  trained from), appends the drops, `BatchConsumed`, `TrainStepFinished` and `UpdateStaged` at once under the step's
  single-writer keys, and waits for the fail-closed transaction: the published version, or `UpdateFailed` naming the
  ranks and their reasons (the old version keeps serving). A full disk while staging (events/disk_full.py) is one
  line naming the file; nothing is appended until the version is staged, once there is room again.

Every wait has a deadline and a stop flag. Nothing here keeps what the log knows: the step, the next version and the
weights' lineage come from the folded state each time. The values it hands out and the errors it raises are
workers.roles.trainer_api's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

import redis
import structlog
import torch

from rolledger.events.archive import iter_run
from rolledger.events.connection import connect
from rolledger.events.disk_full import DiskFull, has_room
from rolledger.events.store import EventLog, RunClosed
from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.schemas.statuses import UpdateStatus
from rolledger.schemas.trajectory import Trajectory
from rolledger.workers.roles.trainer_api import (
    Agreement,
    Batch,
    ClientError,
    Restored,
    RunOver,
    StepRefused,
    StepStats,
    UpdateFailed,
    check_lineage,
    gap_stats,
)
from rolledger.workers.runtime.runtime import Emitter, Follower
from rolledger.workers.weights.staging_format import StagingError
from rolledger.workers.weights.staging_store import StagedUpdate, StagingStore
from rolledger.workers.weights.transport import (
    close_store,
    load_verified,
    open_trainer_store,
    own_copy_uri,
    read_manifest,
    serves_weights,
)
from rolledger.workflows.state import RunState
from rolledger.workflows.trainer import (
    TrainPlan,
    Wait,
    may_record,
    may_train,
    plan_step,
    refusal,
    versions_to_keep,
    weights_version,
)

log = structlog.get_logger("rolledger.client")
POLL_MS = 100
ROOM_POLL_S = 0.5  # how often a stage waiting for room on a full disk looks again


class TrainerClient:
    """See the module docstring. `stop`: a flag that ends every wait (raising RunOver)."""

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        name: str,
        staging: StagingStore,
        *,
        stop: threading.Event | None = None,
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.name = name
        self.log = EventLog(client, run_id)
        self.emitter = Emitter(self.log, name)
        self.follower = Follower(self.log)
        self.staging = staging
        self.stop = stop or threading.Event()
        self.trajectories: dict[str, Trajectory] = {}  # finished samples that may still be trained (`follow`)
        self._agreements: dict[int, Agreement] = {}  # step -> its measured agreement, until published
        self.disk_full = threading.Event()  # set while a stage waits for room (`publish`)

    @classmethod
    def connect(
        cls,
        redis_url: str,
        run_id: str,
        *,
        name: str = "trainer",
        staging_root: str | Path | None = None,
        password: str | None = None,
        username: str | None = None,
        timeout_s: float = 60.0,
    ) -> TrainerClient:
        """Join a run as its trainer: wait (up to `timeout_s`) for its RunStarted, then open the staging store its
        transport uses, at `staging_root` (default: beside the run's model directory, `<run dir>/staging`)."""
        client = connect(redis_url, password=password, username=username)
        log_ = EventLog(client, run_id)
        follower = Follower(log_)
        deadline = time.monotonic() + timeout_s
        while follower.state.config is None:
            if time.monotonic() > deadline:
                raise ClientError(f"run {run_id!r} has no RunStarted after {timeout_s:g} s; start it first")
            follower.catch_up(block_ms=POLL_MS)
        cfg = follower.state.config
        model_dir = Path(cls._model_dir(log_))
        staging = open_trainer_store(cfg, Path(staging_root) if staging_root else model_dir.parent / "staging")
        return cls(client, run_id, name, staging)

    @staticmethod
    def _model_dir(log_: EventLog) -> str:
        for stored in iter_run(log_.client, log_.run_id):  # archive + live: RunStarted may be archived
            if isinstance(stored.event.payload, ev.RunStarted):
                return stored.event.payload.model_dir
        raise ClientError(f"run {log_.run_id!r} has no RunStarted")

    # ------------------------------------------------------------------ what the log says

    @property
    def config(self) -> RunConfig:
        cfg = self.follower.state.config
        if cfg is None:
            raise ClientError(f"run {self.run_id!r}: RunStarted not folded yet (call follow first)")
        return cfg

    @property
    def model_dir(self) -> Path:
        return Path(self._model_dir(self.log))

    def follow(self, block_ms: int = 0) -> int:
        """Fold everything the log has after our position, keeping the finished trajectories a step may still train
        on; how many events came. What can no longer be trained leaves memory as the log says so: the samples a
        completed group did not accept (first k), every sample of a cancelled group, dropped trajectories, samples
        whose reward failed, and a sample that finished after its group closed without it."""
        got = self.follower.catch_up(block_ms=block_ms)
        state = self.follower.state
        held = self.trajectories
        for stored in got:
            p = stored.event.payload
            if isinstance(p, ev.SampleFinished):
                t = p.trajectory
                if may_train(state, t.group_id, t.trajectory_id):
                    held[t.trajectory_id] = t
            elif isinstance(p, ev.GroupCompleted):
                for tid in _group_ids(state, p.group_id):
                    if tid not in p.accepted:
                        held.pop(tid, None)
            elif isinstance(p, ev.GroupCancelled):
                for tid in _group_ids(state, p.group_id):
                    held.pop(tid, None)
            elif isinstance(p, ev.TrajectoryDropped):
                for tid in p.trajectory_ids:
                    held.pop(tid, None)
            elif isinstance(p, ev.SampleFailed) and p.stage == "reward":
                held.pop(p.sample_id, None)
        return len(got)

    def _wait(self, deadline: float | None, what: str) -> None:
        if self.stop.is_set():
            raise RunOver(f"stopped while waiting for {what}")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no {what} before the deadline")
        self.follow(block_ms=POLL_MS)

    # ------------------------------------------------------------------ restore

    def restore(self) -> Restored:
        """The weights this trainer holds per the log, read back from its own copy: its last staged version, or
        the published one when its copy of the last was never completed (that version was then never published:
        the dist transport holds a transfer's last bucket until the copy is written)."""
        self.follow()
        state = self.follower.state
        v = weights_version(state)
        if v == 0:
            return Restored(0, None)
        try:
            return Restored(v, self._read_own(v))
        except StagingError as e:
            published = state.policy_version
            if v == published or e.kind != "not_found":
                raise
            log.warning(
                "the trainer's copy of its last version was not complete when it stopped; that version was never "
                "published: resuming from the published one",
                lost=v,
                resumed=published,
            )
            return Restored(published, self._read_own(published) if published else None)

    def _read_own(self, version: int) -> Mapping[str, torch.Tensor]:
        u = self.follower.state.updates[version]
        uri = own_copy_uri(self.staging, u.uri, version)
        return load_verified(uri, version, read_manifest(uri, version, expected_digest=u.manifest_digest)).tensors

    # ------------------------------------------------------------------ one step

    def next_batch(self, weights: Mapping[str, torch.Tensor] | str, *, timeout_s: float | None = None) -> Batch | None:
        """The next batch, once the run has one; `weights` (a state dict, or its `state_digest`) are what the step
        will train from, checked against the log's lineage first. None when no step is left for a trainer."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.follow()
            plan = plan_step(self.follower.state)
            if isinstance(plan, Wait):
                if self.follower.state.status.is_terminal or plan.reason.is_final:
                    return None
                self._wait(deadline, "batch")
                continue
            if plan.batch is None:  # every selected group was over the lag cap: record the drops, plan again
                self._append(plan.drops, plan.once_keys)
                continue
            return self._batch(plan, weights)

    def _batch(self, plan: TrainPlan, weights: Mapping[str, torch.Tensor] | str) -> Batch:
        parent = check_lineage(weights, self.follower.state)
        assert plan.batch is not None
        missing = [tid for tid in plan.batch.trajectory_ids if tid not in self.trajectories]
        if missing:
            raise ClientError(f"trajectories {missing[:3]} are in the plan but were not followed")
        index = {tid: i for i, tid in enumerate(plan.batch.trajectory_ids)}
        return Batch(
            step=plan.step,
            version=plan.version,
            base_version=plan.base_version,
            weights_version=plan.weights_version,
            parent_digest=parent,
            trajectories=tuple(self.trajectories[tid] for tid in plan.batch.trajectory_ids),
            rewards=plan.rewards,
            lags=plan.batch.lags,
            group_ids=plan.batch.group_ids,
            on_policy=tuple(index[tid] for tid in plan.on_policy),
            plan=plan,
        )

    def agreement(self, batch: Batch, logprobs: Sequence[Sequence[float]]) -> Agreement:
        """Measure the trainer's logprobs of the on-policy trajectories (in `batch.on_policy` order) against the
        engine's; when the gate refuses, record it (TrainStepRefused, and the plan's drops) and raise StepRefused."""
        got = gap_stats(batch.on_policy_trajectories, logprobs)
        refused = refusal(batch.plan, got.median, got.p99, got.tokens, self.config.trainer.max_logprob_gap)
        if refused is not None:
            self._append([*batch.plan.drops, refused], batch.plan.refusal_keys)
            raise StepRefused(refused.reason)
        self._agreements[batch.step] = got
        return got

    def publish(
        self,
        batch: Batch,
        weights: Mapping[str, torch.Tensor],
        stats: StepStats,
        *,
        train_ms: float = 0.0,
        wait: bool = True,
        timeout_s: float | None = None,
    ) -> int:
        """Stage `weights` as `batch.version` and record the step; with `wait`, return the version once published
        or raise UpdateFailed (the old version keeps serving). Without `wait`, return it once recorded."""
        plan = batch.plan
        assert plan.batch is not None
        agreed = self._agreements.pop(batch.step, None)
        if agreed is None:
            raise ClientError(f"step {batch.step}: call agreement() before publish()")
        collected = self.staging.gc(versions_to_keep(self.follower.state))  # at most three versions on disk
        if collected:
            log.debug("staged versions collected", versions=collected)
        staged = self._stage_when_room(plan.version, plan.base_version, weights, batch.parent_digest)
        done = ev.TrainStepFinished(
            step=plan.step,
            loss=stats.loss,
            reward_mean=stats.reward_mean,
            logprob_gap_median=agreed.median,
            logprob_gap_p99=agreed.p99,
            agreement_tokens=agreed.tokens,
            max_seq_ratio=stats.max_seq_ratio,
            clipped_frac=stats.clipped_frac,
            train_ms=train_ms,
            is_truncated_frac=float(getattr(stats, "is_truncated_frac", 0.0)),
        )
        update = ev.UpdateStaged(
            version=plan.version,
            base_version=plan.base_version,
            manifest_digest=staged.manifest_digest,
            weights_digest=staged.manifest.weights_digest,
            uri=staged.uri,
            bytes=staged.bytes,
            tensors=len(staged.manifest.tensors),
            parent_weights_digest=batch.parent_digest,
        )
        self._wait_recordable(plan.version)
        if self._append([*plan.drops, plan.batch, done, update], plan.once_keys):
            for tid in plan.batch.trajectory_ids:
                self.trajectories.pop(tid, None)
        if wait:
            self.wait_published(plan.version, timeout_s=timeout_s)
        return plan.version

    def _stage_when_room(
        self, version: int, base_version: int, weights: Mapping[str, torch.Tensor], parent_digest: str
    ) -> StagedUpdate:
        """Stage `version`; on a full disk (DiskFull: nothing was staged, nothing is appended) say so in one line,
        wait for room, then stage it again: the step is not recorded until its version is on disk. RunOver when the
        run ends or the trainer is stopped meanwhile."""
        full: DiskFull | None = None
        while True:
            try:
                staged = self.staging.stage(version, base_version, weights, parent_digest=parent_digest)
            except DiskFull as e:
                if full is None:
                    log.error(f"{e}; v{version} is not staged: waiting for room", path=str(e.path), need=e.need)
                    self.disk_full.set()
                full = e
                self._wait_for_room(e)
                continue
            if full is not None:
                log.warning(f"room again on {full.path.parent}: v{version} staged")
                self.disk_full.clear()
            return staged

    def _wait_for_room(self, full: DiskFull) -> None:
        """Until the filesystem of `full.path` has the room the write needed (checked every `ROOM_POLL_S`, following
        the log meanwhile); RunOver when the run ends or the trainer is stopped first."""
        while not has_room(full.path, full.need):
            self.follow()
            if self.follower.state.status.is_terminal:
                raise RunOver(f"the run ended ({self.follower.state.status}) while {full.path.parent} was full")
            if self.stop.wait(ROOM_POLL_S):
                raise RunOver(f"stopped while waiting for room on {full.path.parent}")

    def _update_deadline(self, timeout_s: float | None = None) -> float:
        """When a wait on one update gives up: `timeout_s`, else the run's prepare + drain + commit deadlines (what
        the coordinator allows the transaction), plus 30 s of slack; a time.monotonic() value."""
        u = self.config.update
        budget = timeout_s if timeout_s is not None else u.prepare_deadline_s + u.drain_deadline_s + u.commit_deadline_s
        return time.monotonic() + budget + 30.0

    def _wait_recordable(self, version: int) -> None:
        """A step planned beside its last update (`trainer.overlap_update`) is recorded once that update closes
        (`may_record`); RunOver when the run ends first. The deadline: the open update's own, plus slack."""
        deadline = self._update_deadline()
        while True:
            self.follow()
            state = self.follower.state
            if may_record(state):
                return
            if state.status.is_terminal:
                raise RunOver(f"the run ended ({state.status}) before v{version} could be recorded")
            self._wait(deadline, f"the close of the update before v{version}")

    def wait_published(self, version: int, *, timeout_s: float | None = None) -> int:
        """Wait for the update of `version` to resolve: return it once published, UpdateFailed when it aborted,
        RunOver when the run ended first. Default deadline: the run's prepare + drain + commit deadlines."""
        deadline = self._update_deadline(timeout_s)
        while True:
            self.follow()
            state = self.follower.state
            upd = state.updates.get(version)
            if upd is not None and upd.status == UpdateStatus.PUBLISHED:
                return version
            if upd is not None and upd.status == UpdateStatus.ABORTED:
                raise UpdateFailed(version, upd.abort_reason, upd.failed)
            gone = state.retired_updates.get(version)  # closed long ago: its record left the state, its outcome stays
            if gone is not None:
                if gone.status == UpdateStatus.PUBLISHED:
                    return version
                raise UpdateFailed(version, f"aborted (the log's {gone.closing_event} says why)", {})
            if state.status.is_terminal:
                raise RunOver(f"the run ended ({state.status}) before v{version} was published")
            self._wait(deadline, f"publication of v{version}")

    def _append(self, payloads: Sequence[ev.Payload], keys: Sequence[str]) -> bool:
        """Append a step's facts under its single-writer keys, then follow the log up to them; False when a key was
        taken (another trainer, or an earlier incarnation, recorded that step or group)."""
        events = [self.emitter.wrap(p, policy_version=self.follower.state.policy_version) for p in payloads]
        try:
            ids = self.log.append_once(events, keys)
        except RunClosed as exc:  # the run ended while this step was being taken: nothing more to record
            self.emitter.refused(exc, payloads)
            return False
        if ids is None:
            log.warning("step already recorded by another writer", keys=list(keys))
        target = ids[-1] if ids else self.log.last_id()
        while target is not None and _stream_order(self.follower.last_id) < _stream_order(target):
            if self.stop.is_set():
                break
            self.follow(block_ms=POLL_MS)
        return ids is not None

    # ------------------------------------------------------------------ the end

    def serve_until_finished(self, timeout_s: float | None = None) -> None:
        """A trainer that serves the weights (dist transport) keeps serving until the run ends: a rank may still
        need the last version. Returns at once for a directory store."""
        if not serves_weights(self.staging):
            return
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.follower.state.status.is_terminal and not self.stop.is_set():
            if deadline is not None and time.monotonic() > deadline:
                return
            self.follow(block_ms=POLL_MS)

    def close(self) -> None:
        close_store(self.staging)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _group_ids(state: RunState, group_id: str) -> list[str]:
    """The sample ids of a group (its n from the state while it is live, else the run's group size)."""
    g = state.groups.get(group_id)
    n = g.n if g is not None else (state.config.group_size if state.config is not None else 0)
    return [f"{group_id}/{i}" for i in range(n)]


def _stream_order(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)
