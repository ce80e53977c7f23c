"""A fluent builder of minimal, valid rolledger event logs for tests (audit, lineage, reducer, replay, CLI).

It plays every producer at once and emits exactly the event sequences the run loop produces (DESIGN.md data flow):

    b = LogBuilder(group_size=2).start_run()
    b.group()                      # GroupAdmitted, SampleStarted x n, SampleFinished x n, SampleScored x n, GroupCompleted
    b.consume(["g000001"])         # BatchConsumed (+ TrainStepFinished)
    b.update()                     # UpdateStaged .. PolicyPublished, AdmissionResumed: version 1
    b.update(fail_rank=0)          # .. RankPrepareFailed, UpdateAborted, AdmissionResumed: stays on version 1
    events = b.finish_run().build()

Each step is also available on its own (`stage`, `request_prepare`, `prepare`, `pause`, `commit`, `commit_rank`,
`publish`, `abort`, `admit`, `start`, `finish`, ...) so a test can put an offending event exactly where it wants.
Event ids are sortable (`01TEST` + a 20-digit counter) and wall times advance by one second per event, so logs are
deterministic. Digests are readable strings: weights of version v are `w0001`, its manifest `m0001`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from rolledger.events.envelope import make_event
from rolledger.schemas.config import AdmissionConfig, PartialPolicy, RunConfig
from rolledger.schemas.events import (
    AdmissionPaused,
    AdmissionReason,
    AdmissionResumed,
    BatchConsumed,
    CacheInvalidated,
    Event,
    GroupAdmitted,
    GroupCancelled,
    GroupCompleted,
    HealthFailed,
    HealthPassed,
    Payload,
    PolicyPublished,
    PrepareRequested,
    RankCommitted,
    RankJoined,
    RankPrepared,
    RankPrepareFailed,
    RankQuarantined,
    RunFinished,
    RunStarted,
    SampleCancelled,
    SampleFailed,
    SampleFinished,
    SampleScored,
    SampleStarted,
    TrainStepFinished,
    TrajectoryDropped,
    UpdateAborted,
    UpdateCommitted,
    UpdateStaged,
)
from rolledger.schemas.statuses import CacheKind, DropReason, GroupOutcome, PreparePhase, RunStatus
from rolledger.schemas.trajectory import Trajectory


def weights_digest_for(version: int) -> str:
    """The builder's weights digest of `version` (version 0 = the initial weights)."""
    return f"w{version:04d}"


def manifest_digest_for(version: int) -> str:
    return f"m{version:04d}"


def default_config(**overrides: Any) -> RunConfig:
    """A small run: groups of 2, one rank, lag cap 1, a 1 MB byte cap."""
    base: dict[str, Any] = {
        "group_size": 2,
        "ranks": 1,
        "steps": 3,
        "admission": AdmissionConfig(max_queued_bytes=1_000_000, max_lag=1),
    }
    base.update(overrides)
    return RunConfig(**base)


P = TypeVar("P", bound=Payload)


def payload_of(event: Event, cls: type[P]) -> P:
    """The event's payload, which the test knows is a `cls` (asserted, so the payload union narrows)."""
    assert isinstance(event.payload, cls), f"{event.type} is not a {cls.__name__}"
    return event.payload


class LogBuilder:
    """Builds a list of Events; every method returns the builder so calls chain."""

    def __init__(self, config: RunConfig | None = None, *, run_id: str = "run-test", **config_overrides: Any) -> None:
        if config is not None and config_overrides:
            raise ValueError("pass either a RunConfig or overrides, not both")
        self.config = config or default_config(**config_overrides)
        self.run_id = run_id
        self.events: list[Event] = []
        self.version = 0  # last published version
        self.rank_version: dict[int, int] = {r: 0 for r in range(self.config.ranks)}
        self.rank_digest: dict[int, str] = {r: weights_digest_for(0) for r in range(self.config.ranks)}
        self.cache_gen: dict[int, int] = {r: 0 for r in range(self.config.ranks)}
        self.queued_bytes = 0
        self._group_bytes: dict[str, int] = {}
        self._sample_bytes: dict[str, int] = {}  # what each finished sample holds, as the reducer counts it
        self._group_n: dict[str, int] = {}
        self._started: dict[str, SampleStarted] = {}
        self._trajectories: dict[str, Trajectory] = {}
        self._staged: dict[int, tuple[str, str]] = {}  # version -> (manifest digest, weights digest)
        self._n = 0
        self._groups = 0
        self._admitted = 0  # GroupAdmitted events so far
        self._step = 1  # the trainer numbers its steps from 1 (trainer.step + 1 after the initial 0)
        self._fence = 1

    # ------------------------------------------------------------ plumbing
    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.config.ranks))

    def emit(self, payload: Payload, *, producer: str = "test", policy_version: int | None = None) -> LogBuilder:
        """Append any payload as the next event."""
        self._n += 1
        self.events.append(
            make_event(
                payload,
                run_id=self.run_id,
                producer=producer,
                policy_version=self.version if policy_version is None else policy_version,
                wall_time=1_000_000.0 + self._n,
                event_id=f"01TEST{self._n:020d}",
            )
        )
        return self

    @property
    def last(self) -> Event:
        return self.events[-1]

    def find_all(self, type_: str, **fields: Any) -> list[Event]:
        """Events of `type_` whose payload fields equal `fields` (`trajectory_id=` matches SampleFinished)."""
        out = []
        for e in self.events:
            if e.type != type_:
                continue
            p = e.payload
            if isinstance(p, SampleFinished) and "trajectory_id" in fields:
                if p.trajectory.trajectory_id != fields["trajectory_id"]:
                    continue
                rest = {k: v for k, v in fields.items() if k != "trajectory_id"}
            else:
                rest = fields
            if all(getattr(p, k) == v for k, v in rest.items()):
                out.append(e)
        return out

    def find(self, type_: str, **fields: Any) -> Event:
        """The only event matching; AssertionError when there are none or several."""
        found = self.find_all(type_, **fields)
        assert len(found) == 1, f"{len(found)} {type_} events match {fields}"
        return found[0]

    def build(self) -> list[Event]:
        return list(self.events)

    # ------------------------------------------------------------ run
    def start_run(self, *, join_ranks: bool = True) -> LogBuilder:
        """RunStarted, then RankJoined for every rank at version 0."""
        self.emit(RunStarted(config=self.config, initial_weights_digest=weights_digest_for(0), model_dir="/m"))
        if join_ranks:
            for r in self.ranks:
                self.emit(RankJoined(rank=r, engine="torch", policy_version=0, weights_digest=weights_digest_for(0)))
        return self

    def finish_run(self, status: str = "completed") -> LogBuilder:
        return self.emit(RunFinished(status=RunStatus(status), steps=self._step))

    # ------------------------------------------------------------ rollout
    def admit(
        self,
        group_id: str | None = None,
        *,
        n: int | None = None,
        queued_bytes: int | None = None,
        byte_cap: int | None = None,
        partial_policy: PartialPolicy | None = None,
        prompt_index: int | None = -1,
        est_bytes: int | None = None,
    ) -> LogBuilder:
        """GroupAdmitted of the next group; `prompt_index` -1: the admission count (as rolledger admits in FIFO
        order), None: a log from before GroupAdmitted v2; `est_bytes`: what it reserves (default 300 per sample)."""
        if prompt_index == -1:
            prompt_index = self._admitted
        self._admitted += 1
        if group_id is None:
            self._groups += 1
            group_id = f"g{self._groups:06d}"
        n = self.config.group_size if n is None else n
        self._group_n[group_id] = n
        return self.emit(
            GroupAdmitted(
                group_id=group_id,
                prompt_id=f"p-{group_id}",
                prompt_index=prompt_index,
                prompt_token_ids=[1, 2, 3],
                n=n,
                sampling=self.config.sampling,
                partial_policy=partial_policy or self.config.partial_policy,
                answer="5",
                est_remaining_tokens=8 * n,
                est_bytes=300 * n if est_bytes is None else est_bytes,
                queued_bytes=self.queued_bytes if queued_bytes is None else queued_bytes,
                byte_cap=self.config.admission.max_queued_bytes if byte_cap is None else byte_cap,
            ),
            producer="admission",
        )

    def start(
        self, sample_id: str, *, rank: int = 0, version: int | None = None, digest: str | None = None
    ) -> LogBuilder:
        group_id, index = sample_id.rsplit("/", 1)
        v = self.rank_version.get(rank, self.version) if version is None else version
        p = SampleStarted(
            sample_id=sample_id,
            group_id=group_id,
            index=int(index),
            rank=rank,
            policy_version=v,
            weights_digest=digest or self.rank_digest.get(rank, weights_digest_for(v)),
        )
        self._started[sample_id] = p
        return self.emit(p, producer=f"rollout-{rank}")

    def finish(self, sample_id: str, *, nbytes: int | None = None, **trajectory: Any) -> LogBuilder:
        """SampleFinished with a 2-token trajectory stamped from its SampleStarted; keyword args override fields.
        `nbytes`: the size it declares (None: none, as a log from before samples declared their size)."""
        s = self._started[sample_id]
        fields: dict[str, Any] = {
            "trajectory_id": sample_id,
            "group_id": s.group_id,
            "prompt_id": f"p-{s.group_id}",
            "index": s.index,
            "prompt_token_ids": [1, 2, 3],
            "token_ids": [7, 8],
            "loss_mask": [1, 1],
            "positions": [3, 4],
            "logprobs": [-0.5, -0.25],
            "logprob_mode": "raw",
            "finish_reason": "stop",
            "sampling": self.config.sampling,
            "policy_version": s.policy_version,
            "weights_digest": s.weights_digest,
            "rank": s.rank,
            "engine": "torch",
            "cache_generation": self.cache_gen.get(s.rank, 0),
            "graph_generation": 0,
        }
        fields.update(trajectory)
        t = Trajectory(**fields)
        self._trajectories[sample_id] = t
        self._sample_bytes[sample_id] = t.legacy_nbytes if nbytes is None else nbytes
        return self.emit(SampleFinished(trajectory=t, gen_ms=1.0, nbytes=nbytes), producer=f"rollout-{s.rank}")

    def fail(self, sample_id: str, error: str = "engine error") -> LogBuilder:
        s = self._started[sample_id]
        return self.emit(
            SampleFailed(sample_id=sample_id, group_id=s.group_id, index=s.index, rank=s.rank, error=error)
        )

    def cancel(self, sample_id: str, reason: str = "first_k") -> LogBuilder:
        group_id, index = sample_id.rsplit("/", 1)
        return self.emit(SampleCancelled(sample_id=sample_id, group_id=group_id, index=int(index), reason=reason))

    def score(self, sample_id: str, reward: float = 1.0) -> LogBuilder:
        group_id = sample_id.rsplit("/", 1)[0]
        return self.emit(
            SampleScored(sample_id=sample_id, group_id=group_id, reward=reward, correct=reward >= 1.0),
            producer="reward",
        )

    def complete(
        self, group_id: str, accepted: tuple[str, ...] | None = None, *, status: str | None = None
    ) -> LogBuilder:
        """GroupCompleted accepting `accepted` (default: every finished sample of the group)."""
        if accepted is None:
            accepted = tuple(t for t in self._trajectories if t.rsplit("/", 1)[0] == group_id)
        nbytes = sum(self._sample_bytes[a] for a in accepted if a in self._sample_bytes)
        n = self._group_n.get(group_id, len(accepted))
        self._group_bytes[group_id] = nbytes
        self.queued_bytes += nbytes
        st = status or ("complete" if len(accepted) == n else "partial")
        return self.emit(GroupCompleted(group_id=group_id, accepted=accepted, status=GroupOutcome(st), bytes=nbytes))

    def cancel_group(self, group_id: str, reason: str = "deadline") -> LogBuilder:
        return self.emit(GroupCancelled(group_id=group_id, reason=reason))

    def group(
        self,
        group_id: str | None = None,
        *,
        n: int | None = None,
        rank: int = 0,
        finished: int | None = None,
        score: bool = True,
        complete: bool = True,
    ) -> LogBuilder:
        """A whole group: admitted, every sample started; the first `finished` finish (the rest fail), scored,
        completed. The group id is `b.last_group`."""
        self.admit(group_id, n=n)
        gid = self.last_group
        n = self._group_n[gid]
        finished = n if finished is None else finished
        for i in range(n):
            self.start(f"{gid}/{i}", rank=rank)
        for i in range(n):
            if i < finished:
                self.finish(f"{gid}/{i}")
            else:
                self.fail(f"{gid}/{i}")
        if score:
            for i in range(finished):
                self.score(f"{gid}/{i}")
        if complete:
            self.complete(gid)
        return self

    @property
    def last_group(self) -> str:
        for e in reversed(self.events):
            if isinstance(e.payload, GroupAdmitted):
                return e.payload.group_id
        raise LookupError("no group admitted yet")

    def consume(
        self,
        group_ids: list[str] | tuple[str, ...],
        *,
        step: int | None = None,
        lags: tuple[int, ...] | None = None,
        versions: tuple[int, ...] | None = None,
        trajectory_ids: tuple[str, ...] | None = None,
        train: bool = True,
    ) -> LogBuilder:
        """BatchConsumed of the groups' accepted trajectories (lag = published version - group version), then
        TrainStepFinished."""
        step = self._step if step is None else step
        if trajectory_ids is None:
            trajectory_ids = tuple(t for t in self._trajectories if t.rsplit("/", 1)[0] in group_ids)
        if versions is None:
            versions = tuple(
                min((t.policy_version for k, t in self._trajectories.items() if k.rsplit("/", 1)[0] == g), default=0)
                for g in group_ids
            )
        if lags is None:
            lags = tuple(self.version - v for v in versions)
        nbytes = sum(self._group_bytes.pop(g, 0) for g in group_ids)
        self.queued_bytes -= nbytes
        self.emit(
            BatchConsumed(
                step=step,
                group_ids=tuple(group_ids),
                versions=versions,
                lags=lags,
                trajectory_ids=trajectory_ids,
                bytes=nbytes,
            ),
            producer="trainer",
        )
        if train:
            self.emit(
                TrainStepFinished(
                    step=step,
                    loss=0.5,
                    reward_mean=1.0,
                    logprob_gap_median=0.0,
                    logprob_gap_p99=0.0,
                    max_seq_ratio=1.0,
                    clipped_frac=0.0,
                ),
                producer="trainer",
            )
        self._step = step + 1
        return self

    def drop(self, group_id: str, reason: str = "lag", lag: int = 2) -> LogBuilder:
        ids = tuple(t for t in self._trajectories if t.rsplit("/", 1)[0] == group_id)
        self.queued_bytes -= self._group_bytes.pop(group_id, 0)
        return self.emit(TrajectoryDropped(group_id=group_id, trajectory_ids=ids, reason=DropReason(reason), lag=lag))

    # ------------------------------------------------------------ weight update, step by step
    def stage(
        self,
        version: int | None = None,
        *,
        manifest: str | None = None,
        weights: str | None = None,
        uri: str | None = None,
        parent: str | None = None,
    ) -> LogBuilder:
        v = self.version + 1 if version is None else version
        m = manifest or manifest_digest_for(v)
        w = weights or weights_digest_for(v)
        self._staged[v] = (m, w)
        return self.emit(
            UpdateStaged(
                version=v,
                base_version=self.version,
                manifest_digest=m,
                weights_digest=w,
                uri=uri or f"file:///staging/v{v}-{m}",
                bytes=4096,
                tensors=12,
                parent_weights_digest=parent,
            ),
            producer="trainer",
        )

    def _manifest(self, version: int) -> str:
        return self._staged.get(version, (manifest_digest_for(version), ""))[0]

    def _weights(self, version: int) -> str:
        return self._staged.get(version, ("", weights_digest_for(version)))[1]

    def request_prepare(self, version: int, ranks: tuple[int, ...] | None = None) -> LogBuilder:
        return self.emit(
            PrepareRequested(
                version=version,
                manifest_digest=self._manifest(version),
                ranks=self.ranks if ranks is None else ranks,
                deadline=2_000_000.0,
                fence=self._fence,
            ),
            producer="coordinator",
        )

    def prepare(self, version: int, rank: int, *, manifest: str | None = None) -> LogBuilder:
        m = manifest or self._manifest(version)
        return self.emit(
            RankPrepared(version=version, rank=rank, manifest_digest=m, staged_digest=self._weights(version)),
            producer=f"rank-{rank}",
        )

    def prepare_fail(self, version: int, rank: int, *, phase: str = "transfer") -> LogBuilder:
        return self.emit(
            RankPrepareFailed(
                version=version, rank=rank, phase=PreparePhase(phase), tensor="lm_head.weight", reason="checksum"
            ),
            producer=f"rank-{rank}",
        )

    def pause(self, reason: AdmissionReason = AdmissionReason.UPDATE) -> LogBuilder:
        return self.emit(AdmissionPaused(reason=reason, queued_bytes=self.queued_bytes), producer="admission")

    def resume(self, reason: AdmissionReason = AdmissionReason.UPDATE) -> LogBuilder:
        return self.emit(AdmissionResumed(reason=reason), producer="admission")

    def commit(self, version: int, ranks: tuple[int, ...] | None = None, *, manifest: str | None = None) -> LogBuilder:
        return self.emit(
            UpdateCommitted(
                version=version,
                manifest_digest=manifest or self._manifest(version),
                ranks=self.ranks if ranks is None else ranks,
                fence=self._fence,
            ),
            producer="coordinator",
        )

    def commit_rank(
        self,
        version: int,
        rank: int,
        *,
        weights: str | None = None,
        health: bool = True,
        invalidate: bool = True,
        probe: str = "",
    ) -> LogBuilder:
        """RankCommitted, CacheInvalidated(prefix, next generation), HealthPassed (or HealthFailed)."""
        w = weights or self._weights(version)
        self.emit(RankCommitted(version=version, rank=rank, weights_digest=w), producer=f"rank-{rank}")
        self.rank_version[rank] = version
        self.rank_digest[rank] = w
        if invalidate:
            self.cache_gen[rank] = self.cache_gen.get(rank, 0) + 1
            self.emit(
                CacheInvalidated(rank=rank, kind=CacheKind.PREFIX, generation=self.cache_gen[rank], version=version),
                producer=f"rank-{rank}",
            )
        if health:
            passed = HealthPassed(rank=rank, version=version, weights_digest=w, probe_digest=probe)
            return self.emit(passed, producer=f"rank-{rank}")
        return self.emit(HealthFailed(rank=rank, version=version, reason="nan"), producer=f"rank-{rank}")

    def publish(self, version: int, ranks: tuple[int, ...] | None = None, *, weights: str | None = None) -> LogBuilder:
        self.emit(
            PolicyPublished(
                version=version,
                weights_digest=weights or self._weights(version),
                ranks=self.ranks if ranks is None else ranks,
                fence=self._fence,
            ),
            producer="coordinator",
            policy_version=version,
        )
        self.version = max(self.version, version)
        return self

    def abort(self, version: int, reason: str = "prepare failed", failed_ranks: tuple[int, ...] = ()) -> LogBuilder:
        return self.emit(
            UpdateAborted(version=version, reason=reason, failed_ranks=failed_ranks, fence=self._fence),
            producer="coordinator",
        )

    def quarantine(self, rank: int, reason: str = "health") -> LogBuilder:
        return self.emit(RankQuarantined(rank=rank, version=self.rank_version.get(rank, 0), reason=reason))

    def join(self, rank: int, *, version: int | None = None) -> LogBuilder:
        v = self.version if version is None else version
        self.rank_version[rank] = v
        self.rank_digest[rank] = self._weights(v) if v else weights_digest_for(0)
        self.cache_gen[rank] = 0
        return self.emit(RankJoined(rank=rank, engine="torch", policy_version=v, weights_digest=self.rank_digest[rank]))

    # ------------------------------------------------------------ weight update, whole
    def update(
        self,
        version: int | None = None,
        *,
        fail_rank: int | None = None,
        manifest: str | None = None,
        weights: str | None = None,
        uri: str | None = None,
        parent: str | None = None,
    ) -> LogBuilder:
        """A full transaction to `version` (default: next). With `fail_rank`, that rank fails to prepare and the
        update aborts (ranks keep the old version); admission pauses and resumes around it either way."""
        v = self.version + 1 if version is None else version
        self.stage(v, manifest=manifest, weights=weights, uri=uri, parent=parent)
        self.request_prepare(v)
        for r in self.ranks:
            if r == fail_rank:
                self.prepare_fail(v, r)
            else:
                self.prepare(v, r)
        self.pause(AdmissionReason.UPDATE)
        if fail_rank is not None:
            self.abort(v, failed_ranks=(fail_rank,))
            return self.resume(AdmissionReason.UPDATE)
        self.commit(v)
        for r in self.ranks:
            self.commit_rank(v, r)
        self.publish(v)
        return self.resume(AdmissionReason.UPDATE)
