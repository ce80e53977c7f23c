"""Fault injection at run time: the run's pending injections, and the wrappers that make them fire.

The vocabulary (`--inject` specs) is `rolledger.schemas.injection`. Workers never test for faults themselves: a
faulty engine, a faulty staging store or a faulty trainer step wraps the real one and fires the matching injection
once, at its first opportunity.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import ParamSpec, TypeVar

import torch

from rolledger.schemas.config import SamplingParams
from rolledger.schemas.injection import Injection
from rolledger.schemas.weights import WeightManifest
from rolledger.workers.engines.protocol import (
    ArmsFaults,
    CommitReport,
    Engine,
    EngineCapabilities,
    EngineError,
    GroupOutput,
    HealthReport,
    PauseMode,
    SampleOutput,
    SleepReport,
    TensorSpec,
    WakeReport,
    WakeTag,
)
from rolledger.workers.runtime.runtime import WorkerKilled
from rolledger.workers.weights.staging_format import StagingError
from rolledger.workers.weights.transport import load_verified

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class Injector:
    """The run's injections; `take` returns a matching one once and never again, whichever thread asks (a rank's
    rollout slots share one)."""

    def __init__(self, injections: list[Injection] | tuple[Injection, ...] = ()) -> None:
        self._pending = list(injections)
        self.fired: list[Injection] = []
        self._lock = threading.RLock()  # take holds it around its peek

    @property
    def pending(self) -> tuple[Injection, ...]:
        with self._lock:
            return tuple(self._pending)

    def peek(self, kind: str, **match: object) -> Injection | None:
        with self._lock:
            for inj in self._pending:
                if inj.kind == kind and all(getattr(inj, k) == v for k, v in match.items()):
                    return inj
            return None

    def take(self, kind: str, **match: object) -> Injection | None:
        with self._lock:  # peek and remove as one: two threads never both take the same injection
            inj = self.peek(kind, **match)
            if inj is not None:
                self._pending.remove(inj)
                self.fired.append(inj)
            return inj


# ---------------------------------------------------------------- engine and staging faults (rank side)
RANK_FAULTS = ("fail-rank", "corrupt-rank", "stale-weights", "noop-transport")


def wrap_engine(engine: Engine, rank: int, injector: Injector) -> Engine:
    """`engine` wrapped in a FaultyEngine when the run has an injection for this rank (or a rollout kill, which
    fires on whichever rank gets there first); the engine itself otherwise."""
    wanted = any(
        (i.kind in RANK_FAULTS and i.rank == rank) or (i.kind == "kill-worker" and i.worker == "rollout")
        for i in injector.pending
    )
    return FaultyEngine(engine, rank, injector) if wanted else engine


class FaultyEngine:
    """Any Engine, with the rank-side faults of the run's injections; each fires once, through the Injector.

    fail-rank=R@prepare    prepare raises (RankPrepareFailed, phase prepare)
    fail-rank=R@transfer   prepare raises an unreadable-transfer StagingError (phase transfer)
    corrupt-rank=R         one byte of the first tensor flips after reading: the normal verified path reports the
                           checksum mismatch naming the tensor (a remote engine arms the same fault in its workers)
    noop-transport=R       the dist transfer moves nothing (a disabled communicator): the checksums catch it
    fail-rank=R@commit     commit drops the staged weights and raises (HealthFailed, then quarantine)
    stale-weights=R        one commit reports the manifest's version and digest but keeps the old weights: every
                           stamp and digest claims that version until the engine's next commit (the next version,
                           or a rejoin); its health probe runs on the weights it really holds
    kill-worker=rollout@N  generate raises WorkerKilled at the start of the N-th group
    """

    def __init__(self, inner: Engine, rank: int, injector: Injector) -> None:
        self.inner = inner
        self.rank = rank
        self.injector = injector
        self.groups = 0  # groups generated (written under _groups_lock: a rank's slots call generate at once)
        self._groups_lock = threading.Lock()
        self._expected: dict[int, str] = {}  # version -> the manifest's weights digest, learnt at prepare
        self._claim: tuple[int, str] | None = None  # stale-weights: the (version, digest) the engine claims

    # ------------------------------------------------------------ faulty paths
    def prepare(self, version: int, uri: str, manifest: WeightManifest) -> str:
        self._expected[version] = manifest.weights_digest
        fail = self.injector.take("fail-rank", rank=self.rank, phase="prepare")
        if fail is not None:
            raise EngineError(f"injected ({fail.spec})")
        fail = self.injector.take("fail-rank", rank=self.rank, phase="transfer")
        if fail is not None:
            raise StagingError(None, f"transfer interrupted (injected {fail.spec})", kind="unreadable", version=version)
        if self.injector.take("corrupt-rank", rank=self.rank) is not None:
            if isinstance(self.inner, ArmsFaults):  # the remote workers read the files: the fault is armed there
                self.inner.inject("corrupt-prepare")
            else:
                tensors = load_verified(uri, version, manifest, corrupt=manifest.tensors[0].name)
                return self.inner.stage_weights(version, dict(tensors))
        if self.injector.take("noop-transport", rank=self.rank) is not None:
            tensors = load_verified(uri, version, manifest, noop_transport=True)
            return self.inner.stage_weights(version, dict(tensors))
        return self.inner.prepare(version, uri, manifest)

    def commit_weights(self, version: int) -> CommitReport:
        fail = self.injector.take("fail-rank", rank=self.rank, phase="commit")
        if fail is not None:
            self.inner.discard_weights()
            raise EngineError(f"injected {fail.spec}")
        if self._claim is None and self.injector.take("stale-weights", rank=self.rank) is not None:
            self.inner.discard_weights()  # keeps serving the old weights
            self._claim = (version, self._expected.get(version, ""))
            cache_generation = self.inner.reset_prefix_cache()
            return CommitReport(version, self._claim[1], cache_generation, self.inner.graph_generation, False)
        self._claim = None
        return self.inner.commit_weights(version)

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        n: int,
        sampling: SamplingParams,
        *,
        should_cancel: Callable[[int], bool] | None = None,
        on_sample: Callable[[int, SampleOutput], None] | None = None,
        expect_version: int | None = None,
    ) -> GroupOutput:
        with self._groups_lock:
            kill = self.injector.peek("kill-worker", worker="rollout")
            if (
                kill is not None
                and self.groups + 1 >= kill.after
                and self.injector.take("kill-worker", worker="rollout")
            ):
                raise WorkerKilled(f"rollout on rank {self.rank} killed mid-group")  # the killed group is not counted
            self.groups += 1
        # a claimed version is this fault's lie: the inner engine serves its own, so nothing is expected of it then
        kw: dict[str, object] = {
            "should_cancel": should_cancel,
            "expect_version": expect_version if self._claim is None else None,
        }
        if on_sample is not None:
            kw["on_sample"] = lambda i, s: on_sample(i, self._stamped(s))
        out = self.inner.generate(prompt_token_ids, n, sampling, **kw)  # type: ignore[arg-type]  # on_sample: streaming engines only
        if self._claim is None:
            return out
        version, digest = self._claim
        return replace(
            out, samples=[self._stamped(s) for s in out.samples], policy_version=version, weights_digest=digest
        )

    def _stamped(self, s: SampleOutput) -> SampleOutput:
        if self._claim is None or not s.spans:
            return s
        return replace(s, spans=tuple((b, self._claim[0], self._claim[1]) for b, _, _ in s.spans))

    @property
    def policy_version(self) -> int:
        return self._claim[0] if self._claim is not None else self.inner.policy_version

    def weights_digest(self) -> str:
        return self._claim[1] if self._claim is not None else self.inner.weights_digest()

    # ------------------------------------------------------------ the rest: the real engine
    @property
    def capabilities(self) -> EngineCapabilities:
        return self.inner.capabilities

    def pause(self, mode: PauseMode) -> None:
        self.inner.pause(mode)

    def resume(self) -> None:
        self.inner.resume()

    @property
    def is_paused(self) -> bool:
        return self.inner.is_paused

    def sleep(self, level: int) -> SleepReport:
        return self.inner.sleep(level)

    def wake(self, tags: Sequence[WakeTag]) -> WakeReport:
        return self.inner.wake(tags)

    @property
    def asleep_level(self) -> int:
        return self.inner.asleep_level

    def kv_cache_tokens(self) -> int | None:
        return self.inner.kv_cache_tokens()

    def live_tensor_specs(self) -> Mapping[str, TensorSpec]:
        return self.inner.live_tensor_specs()

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> str:
        return self.inner.stage_weights(version, tensors)

    @property
    def cache_generation(self) -> int:
        return self.inner.cache_generation

    @property
    def graph_generation(self) -> int:
        return self.inner.graph_generation

    def discard_weights(self) -> None:
        self.inner.discard_weights()

    def reset_prefix_cache(self) -> int:
        return self.inner.reset_prefix_cache()

    def health(self) -> HealthReport:
        return self.inner.health()

    def close(self) -> None:
        self.inner.close()


# ---------------------------------------------------------------- trainer and worker faults
# A worker exposes the part a fault wraps as a typed attribute (the trainer's `train`, the coordinator's
# `append_decisions`, the reward worker's `scorer`); the driver replaces it with the wrapper. A wrapper fires its
# injection once and is inert after, so a restarted worker may be wrapped again without the fault firing twice.


def slow_and_mortal_trainer(train: Callable[P, R], injector: Injector) -> Callable[P, R]:
    """The trainer's step, with delay-trainer=S (sleeps S seconds before its first step) and kill-worker=trainer@N
    (dies before its N-th step, with nothing of that step appended)."""
    calls = 0

    def step(*args: P.args, **kwargs: P.kwargs) -> R:
        nonlocal calls
        calls += 1
        delay = injector.take("delay-trainer")
        if delay is not None:
            time.sleep(delay.seconds)  # the injected fault itself: a slow trainer
        kill = injector.peek("kill-worker", worker="trainer")
        if kill is not None and calls >= kill.after:
            injector.take("kill-worker", worker="trainer")
            raise WorkerKilled(f"trainer killed before its step (call {calls})")
        return train(*args, **kwargs)

    return step


def mortal_coordinator(append: Callable[P, bool], injector: Injector) -> Callable[P, bool]:
    """The coordinator's decision appender, with kill-worker=coordinator@N: dies right after its N-th decision is in
    the log (what a successor must finish)."""
    decisions = 0

    def appended(*args: P.args, **kwargs: P.kwargs) -> bool:
        nonlocal decisions
        ok = append(*args, **kwargs)
        if ok:
            decisions += 1
            kill = injector.peek("kill-worker", worker="coordinator")
            if kill is not None and decisions >= kill.after:
                injector.take("kill-worker", worker="coordinator")
                raise WorkerKilled(f"coordinator killed after {decisions} decisions")
        return ok

    return appended


def mortal_scorer(score: Callable[P, Sequence[T]], injector: Injector) -> Callable[P, Sequence[T]]:
    """The reward worker's scorer, with kill-worker=reward@N: dies once N samples would have been scored, before
    their scores are appended or their entries acknowledged (a successor reclaims them)."""
    scored = 0

    def scorer(*args: P.args, **kwargs: P.kwargs) -> Sequence[T]:
        nonlocal scored
        out = score(*args, **kwargs)
        kill = injector.peek("kill-worker", worker="reward")
        if out and kill is not None and scored + len(out) >= kill.after:
            injector.take("kill-worker", worker="reward")
            raise WorkerKilled(f"reward worker killed with {len(out)} scores unappended")
        scored += len(out)
        return out

    return scorer
