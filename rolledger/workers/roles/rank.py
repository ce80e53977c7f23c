"""The rank worker: one inference rank, a thin interpreter of `workflows.rank.decide_rank`.

Each RankWorker is an incarnation (a fresh id): it announces itself in RankJoined, a restarted one first loads the
version the log says the rank holds (workflows.rank), and its rollout slots start only once the log holds its own
RankJoined.

The control thread loops: fold everything in the log (fully caught up), decide from the folded state and the
engine's local facts, execute each action against the engine and append its events, then catch up again before the
next decision, so the decider always sees its own results and never repeats an action. It keeps no copy of what the
reducer knows; the only facts it holds are the engine's own (groups running, the version staged, a failed load).

The ranks of one process share one fold of the log (`runtime.shared_follower`: with 16 ranks in `rolledger run`,
each folding every event was half of the control plane's CPU) and its lock. The lock guards the folded state and each
rank's running-group count (the groups of all its slots): every control thread folds and decides under it, the slots
read the state under it, and "may I start a group" (a slot) and "report drained / sleep" (control) are decided under
it on the same state. Since other ranks' threads fold the shared state too, it can move on between a rank's decision
and its report; so the report holds the rank's starts (`starts_held_through`) from the check that no group runs until
the follower has folded the report itself: a group can never start after this rank reported EnginePaused (or
EngineSlept), and a drain (but a `keep` pause, which parks them) waits until no slot runs a group. A `keep` drain
still waits until every running group's SampleStarted is in the log (`announcing`), so the log never shows a group
starting after the rank paused. Faults are not here: a FaultyEngine (workers/operator/faults.py) wraps the engine when the run
has injections for this rank.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal, cast

import redis
import torch

from rolledger.schemas import events as ev
from rolledger.schemas.statuses import CacheKind, DrainMode, LogprobMode, PreparePhase, RunStatus, WakeTag
from rolledger.workers.engines.protocol import CommitReport, Engine, IllegalEngineOrder, WeightValidationError
from rolledger.workers.roles.rollout import Rollout
from rolledger.workers.runtime.runtime import Worker, shared_follower
from rolledger.workers.weights.staging_format import StagingError
from rolledger.workers.weights.transport import read_manifest
from rolledger.workflows import rank as rd
from rolledger.workflows.health import acceptance_drop
from rolledger.workflows.state import RunState

_ANNOUNCE_WITHIN_S = 5.0  # how long a failed prepare's report waits for running groups' SampleStarted


class RankWorker(Worker):
    kind = "rank"

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        rank: int,
        engine: Engine,
        *,
        claim_idle_ms: int | None = None,
        initial_weights: Callable[[], dict[str, torch.Tensor]] | None = None,
        tokenizer: Any = None,
    ) -> None:
        super().__init__(client, run_id, f"rank-{rank}")
        self.rank = rank
        self.engine = engine
        # the policy's tokenizer: an episode's turns as text for its environment, and its text replies as tokens
        # (None: an environment must answer token ids; workers/roles/episodes.py)
        self.tokenizer = tokenizer
        self.incarnation = uuid.uuid4().hex[:12]  # this rank process; announced in its RankJoined
        self.initial_weights = initial_weights
        self.follower = shared_follower(self.log)  # the process's ranks share one fold and its lock
        self.lock = self.follower.lock  # notified after every fold; guards the state, running and announcing
        self.running = 0  # groups the rollout slots are generating (written under the lock)
        self.announcing = 0  # of those, started but their SampleStarted not yet in the log (written under the lock)
        # no group starts until the follower has folded this stream id ("" : until it is set; None: no hold); set
        # around this rank's own reports that stop generation (`_emit_holding_starts`)
        self.starts_held_through: str | None = None
        self._staged: int | None = None  # the version the engine holds staged
        self._failed_load: int | None = None  # the version a rejoin/reload last failed on
        self.rollout = Rollout(self, claim_idle_ms)

    @property
    def state(self) -> RunState:
        """The folded state (shared by the process's ranks); read it under `lock`."""
        return self.follower.state

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        acted = True
        while not self.stop_event.is_set():
            # own appends (this thread's and the slots') surely; the rest as this process's tail brings it. Until
            # this rank has appended anything, and once the store refuses its appends (the run is over), up to the
            # log's end: with nothing of its own to read through, it would otherwise never read the log again
            # (tests/test_late_start.py)
            own = self.emitter.last_id
            through = None if own == "0-0" or self.emitter.closed else own
            self.follower.catch_up(block_ms=0 if acted else 100, through=through)
            with self.lock:
                if RunStatus(self.state.status).is_terminal:
                    break
                me = self.state.ranks.get(self.rank)
                joined = me is not None and me.incarnation == self.incarnation  # the log holds our own RankJoined
                actions = rd.decide_rank(self.state, self.rank, self.local())
            acted = False
            for action in actions:
                acted = self.execute(action) or acted
            if joined:
                self.rollout.ensure_running()  # a killed rollout slot is replaced; its entry is reclaimed
        self.stop_event.set()  # the run is over (or we were stopped): the rollout slots end too
        self.rollout.join(timeout=30)

    def local(self) -> rd.RankLocal:
        with self.lock:
            running = self.running
        return rd.RankLocal(
            running=running,
            engine_paused=self.engine.is_paused,
            staged_version=self._staged,
            live_version=self.engine.policy_version,
            interruptible=self.engine.capabilities.interruptible,
            failed_load=self._failed_load,
            incarnation=self.incarnation,
        )

    def emit(self, *payloads: ev.Payload, cause: str) -> None:
        """Append the events answering the command `cause` (their causation id)."""
        self.emitter.emit(list(payloads), policy_version=self.engine.policy_version, causation_id=cause or None)

    # ------------------------------------------------------------------ actions
    def execute(self, action: rd.RankAction) -> bool:
        """Carry out one action; False when it no longer applies (a group started meanwhile) and nothing was done."""
        match action:
            case rd.Join():
                self._announce(self.engine.policy_version, self.engine.weights_digest(), action.cause)
            case rd.Prepare():
                self._prepare(action)
            case rd.Pause(mode=mode):
                self.engine.pause(mode)
            case rd.ReportDrained(mode=mode):
                with self.lock:
                    if self.running and mode != "keep":
                        return False
                    if self.announcing:  # keep parks running groups, but each must be in the log before the pause
                        return False
                    self.starts_held_through = ""  # from this check until the report is folded (the module's doc)
                if not self.engine.is_paused:
                    self.engine.pause(mode)
                self._emit_holding_starts(ev.EnginePaused(rank=self.rank, mode=DrainMode(mode)), cause=action.cause)
            case rd.Commit():
                self._commit(action)
            case rd.Probe(version=version):
                self._probe(version, action.cause)
            case rd.Sleep(level=level, drain_mode=mode):
                with self.lock:
                    if self.running:
                        return False
                    self.starts_held_through = ""  # from this check until the report is folded (the module's doc)
                try:
                    if not self.engine.is_paused:
                        self.engine.pause(mode)
                    report = self.engine.sleep(level)
                except BaseException:
                    self._release_starts()
                    raise
                self._emit_holding_starts(
                    ev.EngineSlept(
                        rank=self.rank,
                        level=cast(Literal[1, 2], level),
                        bytes_freed=report.bytes_freed,
                        verified=report.verified,
                    ),
                    cause=action.cause,
                )
            case rd.Wake(tags=tags):
                self._wake(tags, action.cause)
            case rd.WakeOnPublished(level=level, tags=tags, source=src):
                if "weights" in tags:
                    self._wake(("weights",), action.cause)
                if level == 2:  # the weights were dropped: the published version comes back through the verified path
                    self._load(src)
                if "kv_cache" in tags:
                    self._wake(("kv_cache",), action.cause)
            case rd.Resume():
                if self.engine.is_paused:
                    self.engine.resume()
                self.emit(ev.EngineResumed(rank=self.rank), cause=action.cause)
            case rd.Discard():
                self.engine.discard_weights()
                self._staged = None
            case rd.Rejoin(source=src, wake=tags):
                try:
                    if "weights" in tags:  # quarantined mid-handoff; the quarantine already ended the sleep in the log
                        self.engine.wake(["weights"])
                    loaded = self._load(src)
                    if "kv_cache" in tags:
                        self.engine.wake(["kv_cache"])
                except Exception as exc:  # noqa: BLE001 - the rank stays quarantined; the log says why it is
                    self.logger.error("rejoin failed; rank stays quarantined", error=str(exc))
                    self._failed_load = src.version
                    return False
                self._failed_load = None
                self._announce(src.version, loaded.weights_digest, action.cause)
            case rd.Reload(source=src):
                try:
                    self._load(src)
                except Exception as exc:  # noqa: BLE001 - it does not serve until its engine holds the logged version
                    self.logger.error("reload failed", version=src.version, error=str(exc))
                    self._failed_load = src.version
                    return False
                self._failed_load = None
        return True

    def _announce(self, version: int, digest: str, cause: str) -> None:
        caps = self.engine.capabilities
        self.emit(
            ev.RankJoined(
                rank=self.rank,
                engine=caps.name,
                policy_version=version,
                weights_digest=digest,
                sleep_levels=caps.sleep_levels,
                logprob_mode=LogprobMode(caps.logprob_mode),
                incarnation=self.incarnation,
            ),
            cause=cause,
        )

    def _prepare(self, a: rd.Prepare) -> None:
        started = time.perf_counter()
        try:
            staged = self.engine.prepare(
                a.version, a.uri, read_manifest(a.uri, a.version, expected_digest=a.manifest_digest)
            )
        except StagingError as exc:
            phase = "transfer" if exc.kind in ("unreadable", "truncated", "transport") else "prepare"
            self._prepare_failed(
                ev.RankPrepareFailed(
                    version=a.version, rank=self.rank, phase=PreparePhase(phase), tensor=exc.tensor, reason=str(exc)
                ),
                a.cause,
            )
            return
        except Exception as exc:  # noqa: BLE001 - the engine refused (shape/dtype) or anything else: fail closed
            tensor = exc.tensor if isinstance(exc, WeightValidationError) else None
            self._prepare_failed(
                ev.RankPrepareFailed(
                    version=a.version, rank=self.rank, phase=PreparePhase.PREPARE, tensor=tensor, reason=str(exc)
                ),
                a.cause,
            )
            return
        self._staged = a.version
        self.emit(
            ev.RankPrepared(
                version=a.version,
                rank=self.rank,
                manifest_digest=a.manifest_digest,
                staged_digest=staged,
                prepare_ms=(time.perf_counter() - started) * 1e3,
            ),
            cause=a.cause,
        )

    def _prepare_failed(self, failed: ev.RankPrepareFailed, cause: str) -> None:
        """Report a failed prepare so that no group of this rank shows in the log after the quarantine that answers
        it: starts are held from now until the follower has folded the report (the rollout then sees the failure,
        `about_to_be_quarantined`), and the groups already started are announced (SampleStarted in the log) first."""
        with self.lock:
            self.starts_held_through = ""
            deadline = time.monotonic() + _ANNOUNCE_WITHIN_S
            while self.announcing and time.monotonic() < deadline:
                self.lock.wait(timeout=0.05)  # woken by each announcement
        self._emit_holding_starts(failed, cause=cause)

    def _emit_holding_starts(self, *payloads: ev.Payload, cause: str) -> None:
        """Append a report that stops this rank's generation, its caller having set `starts_held_through` to ""
        (no start) under the lock: afterwards starts stay held until the follower has folded the report, whoever
        folds it, so no slot starts a group on a state that does not hold it yet."""
        try:
            self.emit(*payloads, cause=cause)
        finally:
            self._release_starts()

    def _release_starts(self) -> None:
        """Hold starts only until the follower has folded this rank's newest append (already folded: no hold)."""
        with self.lock:
            self.starts_held_through = self.emitter.last_id
            self.lock.notify_all()

    def _commit(self, a: rd.Commit) -> None:
        started = time.perf_counter()
        try:
            if a.reload:  # a restarted engine holds nothing staged: prepare it again through the verified path
                self.engine.prepare(
                    a.version, a.uri, read_manifest(a.uri, a.version, expected_digest=a.manifest_digest)
                )
            report = self.engine.commit_weights(a.version)
        except IllegalEngineOrder as exc:
            self.emit(
                ev.CommandRefused(command=f"commit v{a.version}", reason=str(exc), rank=self.rank),
                ev.HealthFailed(rank=self.rank, version=a.version, reason=f"commit refused: {exc}"),
                cause=a.cause,
            )
            return
        except Exception as exc:  # noqa: BLE001 - any failure is reported as an event; the rank fails closed
            self.emit(ev.HealthFailed(rank=self.rank, version=a.version, reason=f"commit failed: {exc}"), cause=a.cause)
            return
        finally:
            self._staged = None
        events: list[ev.Payload] = [
            ev.RankCommitted(
                version=a.version,
                rank=self.rank,
                weights_digest=report.weights_digest,
                commit_ms=(time.perf_counter() - started) * 1e3,
            ),
            ev.CacheInvalidated(
                rank=self.rank, kind=CacheKind.PREFIX, generation=report.cache_generation, version=a.version
            ),
        ]
        if report.graphs_invalidated:
            events.append(
                ev.CacheInvalidated(
                    rank=self.rank, kind=CacheKind.GRAPH, generation=report.graph_generation, version=a.version
                )
            )
        self.emit(*events, cause=a.cause)

    def _probe(self, version: int, cause: str) -> None:
        try:
            health = self.engine.health()
        except Exception as exc:  # noqa: BLE001 - a probe that cannot run failed
            self.emit(ev.HealthFailed(rank=self.rank, version=version, reason=f"probe failed: {exc}"), cause=cause)
            return
        if not health.ok:
            self.emit(ev.HealthFailed(rank=self.rank, version=version, reason=health.detail), cause=cause)
            return
        with self.lock:  # the run's threshold, from the config the log's RunStarted holds
            cfg = self.state.config
        max_drop = cfg.update.max_spec_acceptance_drop if cfg is not None else 1.0
        dropped = acceptance_drop(health.spec_acceptance_before, health.spec_acceptance_rate, max_drop)
        if dropped:
            self.emit(
                ev.HealthFailed(rank=self.rank, version=version, reason=f"rank {self.rank}: {dropped}"), cause=cause
            )
            return
        self.emit(
            ev.HealthPassed(
                rank=self.rank,
                version=version,
                weights_digest=self.engine.weights_digest(),
                probe_digest=health.probe_digest,
                spec_acceptance_rate=health.spec_acceptance_rate,
                spec_acceptance_before=health.spec_acceptance_before,
            ),
            cause=cause,
        )

    def _wake(self, tags: tuple[rd.WakeTag, ...], cause: str) -> None:
        report = self.engine.wake(tags)
        self.emit(
            ev.EngineWoke(rank=self.rank, tags=tuple(WakeTag(t) for t in tags), bytes_restored=report.bytes_restored),
            cause=cause,
        )

    def _load(self, src: rd.Source) -> CommitReport:
        """Swap in a decided version read back through the verified path (version 0: the initial weights)."""
        if src.uri:
            self.engine.prepare(
                src.version, src.uri, read_manifest(src.uri, src.version, expected_digest=src.manifest_digest)
            )
        else:
            if self.initial_weights is None:
                raise RuntimeError(f"rank {self.rank} has no source for the initial weights")
            self.engine.stage_weights(src.version, dict(self.initial_weights()))
        self._staged = None
        return self.engine.commit_weights(src.version)
