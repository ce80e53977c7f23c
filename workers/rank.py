"""The rank worker: one inference rank. Generates the groups it takes from the `rollout` consumer group, and takes
part in every weight-update transaction as that rank's agent.

Two threads share one engine:
- the control thread follows the log and acts on what concerns this rank: PrepareRequested (read the staged update,
  verify every checksum, validate into the engine's inactive buffer -> RankPrepared | RankPrepareFailed),
  AdmissionPaused(update) (stop starting groups, drain, pause -> EnginePaused), UpdateCommitted (swap, invalidate the
  prefix cache and graphs, health probe -> RankCommitted, CacheInvalidated, HealthPassed | HealthFailed),
  PolicyPublished / UpdateAborted (discard what is staged, resume -> EngineResumed), RankQuarantined (reload the
  published version from the staging store and rejoin -> RankJoined);
- the rollout thread reads GroupAdmitted entries (acking every other entry type at once), waits until the rank may
  serve, and generates the group: SampleStarted for each sample, then SampleFinished with the whole trajectory or
  SampleCancelled when the coordinator closed the group meanwhile. A group reclaimed from a dead worker first has its
  orphaned samples closed with SampleFailed, so no sample is counted twice and none is left without a terminal event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import redis
import torch

from rolledger.events.consumer import Delivery, GroupConsumer
from rolledger.schemas import events as ev
from rolledger.schemas.trajectory import Trajectory, VersionSpan
from rolledger.workers.engine import Engine, GroupOutput, IllegalEngineOrder, SampleOutput
from rolledger.workers.faults import Injector
from rolledger.workers.runtime import Follower, Worker, WorkerKilled
from rolledger.workers.staging import StagingError, load_verified, read_manifest


class RankWorker(Worker):
    kind = "rank"

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        rank: int,
        engine: Engine,
        *,
        injector: Injector | None = None,
        claim_idle_ms: int = 5000,
        initial_weights: Callable[[], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        super().__init__(client, run_id, f"rank-{rank}")
        self.rank = rank
        self.engine = engine
        self.injector = injector or Injector()
        self.claim_idle_ms = claim_idle_ms
        self.initial_weights = initial_weights
        self.follower = Follower(self.log)
        self._gate = threading.Condition()
        self._serving = False  # may the rollout thread start a group?
        self._busy = False  # is it generating one?
        self._drained_for: int | None = None  # version whose drain this rank has reported
        self._claim: tuple[int, str] | None = None  # stale-weights injection: the (version, digest) the rank claims
        self._resume_when_closed = False  # rejoined mid-transaction: serve again once it is published or aborted
        self._sleep_pending = False  # colocated: a handoff began; sleep once the current group is done
        self._asleep: list[str] = []  # tags still asleep, in wake order ("weights", "kv_cache")
        self._sleep_level = 0
        self._rollout: threading.Thread | None = None
        self._rollout_incarnation = 0
        self.groups_done = 0

    # ------------------------------------------------------------------ control thread
    def run(self) -> None:
        self.follower.catch_up()
        state = self.follower.state
        if self.rank not in state.ranks:
            caps = self.engine.capabilities
            self._emit(
                ev.RankJoined(
                    rank=self.rank,
                    engine=caps.name,
                    policy_version=self.engine.policy_version,
                    weights_digest=self.engine.weights_digest(),
                    sleep_levels=caps.sleep_levels,
                    logprob_mode=caps.logprob_mode,
                )
            )
        self._set_serving(True)
        self._start_rollout()
        while not self.stop_event.is_set():
            for stored in self.follower.poll(block_ms=100):
                self._react(stored.event)
            self._report_drained()
            self._sleep_when_drained()
            if self._rollout is not None and not self._rollout.is_alive() and not self.stop_event.is_set():
                self._start_rollout()  # a killed rollout thread is replaced; the new one reclaims its entries
            if self.follower.state.status in ("completed", "failed", "aborted"):
                break
        self._set_serving(False)
        if self._rollout is not None:
            self._rollout.join(timeout=30)

    def _emit(self, *payloads: ev.Payload, causation_id: str | None = None) -> None:
        self.emitter.emit(list(payloads), policy_version=self.engine.policy_version, causation_id=causation_id)

    def _set_serving(self, serving: bool) -> None:
        with self._gate:
            self._serving = serving
            self._gate.notify_all()

    def _mine(self, ranks: tuple[int, ...] | list[int]) -> bool:
        return self.rank in ranks

    def _react(self, e: ev.Event) -> None:
        p = e.payload
        if isinstance(p, ev.PrepareRequested) and self._mine(p.ranks):
            self._prepare(p, e.event_id)
        elif isinstance(p, ev.AdmissionPaused) and p.reason == "update":
            u = self.follower.state.open_update
            if u is not None and self._mine(u.ranks):
                self._set_serving(False)
                if self.follower.state.config and self.follower.state.config.update.drain_mode == "abort":
                    self.engine.pause("abort")
        elif isinstance(p, ev.AdmissionPaused) and p.reason == "handoff":
            me = self.follower.state.ranks.get(self.rank)
            if me is not None and me.status != "quarantined":
                self._set_serving(False)
                self._sleep_pending = True
        elif isinstance(p, ev.UpdateCommitted) and self._mine(p.ranks):
            self._commit(p, e.event_id)
        elif isinstance(p, ev.PolicyPublished) and (self._mine(p.ranks) or self._resume_when_closed):
            self._resume(e.event_id)
        elif isinstance(p, ev.UpdateAborted):
            self.engine.discard_weights()
            if (
                self.follower.state.ranks.get(self.rank)
                and self.follower.state.ranks[self.rank].status != "quarantined"
            ):
                if self._asleep:
                    self._wake_on_old_weights(e.event_id)
                self._resume(e.event_id)
        elif isinstance(p, ev.RankQuarantined) and p.rank == self.rank:
            self._rejoin(e.event_id)

    def _prepare(self, p: ev.PrepareRequested, cause: str) -> None:
        u = self.follower.state.updates[p.version]
        started = time.perf_counter()
        fail = self.injector.take("fail-rank", rank=self.rank, phase="prepare")
        if fail is not None:
            self._emit(
                ev.RankPrepareFailed(
                    version=p.version, rank=self.rank, phase="prepare", reason=f"injected ({fail.spec})"
                ),
                causation_id=cause,
            )
            return
        if "weights" in self._asleep:  # colocated: the weights wake first; weights are never sent to a sleeping engine
            self._wake(["weights"], cause)
        try:
            manifest = read_manifest(u.uri, expected_digest=p.manifest_digest)
            fail = self.injector.take("fail-rank", rank=self.rank, phase="transfer")
            if fail is not None:
                raise StagingError(
                    None, f"transfer interrupted (injected {fail.spec})", kind="unreadable", version=p.version
                )
            corrupt = self.injector.take("corrupt-rank", rank=self.rank)
            prepare_from_uri = getattr(self.engine, "prepare_from_uri", None)
            if prepare_from_uri is not None:  # a remote engine (vLLM) reads and verifies the staged files itself
                if corrupt:
                    self.engine.inject("corrupt-prepare")  # type: ignore[attr-defined]
                staged = prepare_from_uri(p.version, u.uri, manifest)
            else:
                tensors = load_verified(u.uri, manifest, corrupt=manifest.tensors[0].name if corrupt else None)
                staged = self.engine.stage_weights(p.version, dict(tensors))
        except StagingError as exc:
            phase = "transfer" if exc.kind in ("unreadable", "truncated") else "prepare"
            self._emit(
                ev.RankPrepareFailed(
                    version=p.version, rank=self.rank, phase=phase, tensor=exc.tensor, reason=str(exc)
                ),
                causation_id=cause,
            )  # type: ignore[arg-type]
            return
        except Exception as exc:  # noqa: BLE001 - the engine refused (shape/dtype) or anything else: fail closed
            self._emit(
                ev.RankPrepareFailed(
                    version=p.version,
                    rank=self.rank,
                    phase="prepare",
                    tensor=getattr(exc, "tensor", None),
                    reason=str(exc),
                ),
                causation_id=cause,
            )
            return
        self._emit(
            ev.RankPrepared(
                version=p.version,
                rank=self.rank,
                manifest_digest=p.manifest_digest,
                staged_digest=staged,
                prepare_ms=(time.perf_counter() - started) * 1e3,
            ),
            causation_id=cause,
        )

    def _report_drained(self) -> None:
        """Once generation stopped for the open update: pause the engine and say so (the coordinator commits then)."""
        u = self.follower.state.open_update
        if u is None or u.status != "preparing" or "update" not in self.follower.state.admission.paused:
            return
        if not self._mine(u.ranks) or self._drained_for == u.version or self._asleep:
            return  # (a sleeping rank generates nothing: it is drained by construction)
        cfg = self.follower.state.config
        interruptible = bool(cfg and cfg.interruptible and self.engine.capabilities.interruptible)
        with self._gate:
            if self._busy and not interruptible:
                return
        # interruptible: park the running group at its next decode step; it continues on the new weights
        mode = "keep" if interruptible else (cfg.update.drain_mode if cfg else "wait")
        if not self.engine.is_paused:
            self.engine.pause(mode)
        self._drained_for = u.version
        self._emit(ev.EnginePaused(rank=self.rank, mode=mode))

    def _commit(self, p: ev.UpdateCommitted, cause: str) -> None:
        started = time.perf_counter()
        fail = self.injector.take("fail-rank", rank=self.rank, phase="commit")
        if fail is not None:
            self.engine.discard_weights()
            self._emit(
                ev.HealthFailed(rank=self.rank, version=p.version, reason=f"commit failed (injected {fail.spec})"),
                causation_id=cause,
            )
            return
        if self.injector.take("stale-weights", rank=self.rank) is not None or self._claim is not None:
            # the fault: claim the manifest's version and digest, keep serving the old weights
            self._claim = (p.version, self.follower.state.updates[p.version].weights_digest)
        try:
            if self._claim is not None:
                self.engine.discard_weights()
                events: list[ev.Payload] = [
                    ev.RankCommitted(version=p.version, rank=self.rank, weights_digest=self._claim[1])
                ]
            else:
                report = self.engine.commit_weights(p.version)
                events = [
                    ev.RankCommitted(
                        version=p.version,
                        rank=self.rank,
                        weights_digest=report.weights_digest,
                        commit_ms=(time.perf_counter() - started) * 1e3,
                    ),
                    ev.CacheInvalidated(
                        rank=self.rank, kind="prefix", generation=report.cache_generation, version=p.version
                    ),
                ]
                if report.graphs_invalidated:
                    events.append(
                        ev.CacheInvalidated(
                            rank=self.rank, kind="graph", generation=report.graph_generation, version=p.version
                        )
                    )
        except IllegalEngineOrder as exc:
            self._emit(
                ev.CommandRefused(command=f"commit v{p.version}", reason=str(exc), rank=self.rank),
                ev.HealthFailed(rank=self.rank, version=p.version, reason=f"commit refused: {exc}"),
                causation_id=cause,
            )
            return
        except Exception as exc:  # noqa: BLE001 - any failure is reported as an event; the rank fails closed
            self._emit(
                ev.HealthFailed(rank=self.rank, version=p.version, reason=f"commit failed: {exc}"), causation_id=cause
            )
            return
        if "kv_cache" in self._asleep:  # colocated: the KV cache wakes after the new weights are in, before the probe
            report_kv = self.engine.wake(["kv_cache"])
            self._asleep.remove("kv_cache")
            events.append(ev.EngineWoke(rank=self.rank, tags=("kv_cache",), bytes_restored=report_kv.bytes_restored))
        health = self.engine.health()
        if health.ok:
            events.append(
                ev.HealthPassed(
                    rank=self.rank, version=p.version, weights_digest=self._stamp()[1], probe_digest=health.probe_digest
                )
            )
        else:
            events.append(ev.HealthFailed(rank=self.rank, version=p.version, reason=health.detail))
        self._emit(*events, causation_id=cause)

    def _sleep_when_drained(self) -> None:
        """Colocated handoff: once the current group is done, pause and sleep at the run's level."""
        if not self._sleep_pending:
            return
        with self._gate:
            if self._busy:
                return
        cfg = self.follower.state.config
        level = cfg.sleep_level if cfg else 1
        if not self.engine.is_paused:
            self.engine.pause(cfg.update.drain_mode if cfg else "wait")
        report = self.engine.sleep(level)
        self._sleep_pending = False
        self._asleep, self._sleep_level = ["weights", "kv_cache"], level
        self._emit(
            ev.EngineSlept(rank=self.rank, level=level, bytes_freed=report.bytes_freed, verified=report.verified)
        )  # type: ignore[arg-type]

    def _wake(self, tags: list[str], cause: str) -> None:
        report = self.engine.wake(tags)  # type: ignore[arg-type]
        for t in tags:
            self._asleep.remove(t)
        self._emit(
            ev.EngineWoke(rank=self.rank, tags=tuple(tags), bytes_restored=report.bytes_restored), causation_id=cause
        )  # type: ignore[arg-type]

    def _wake_on_old_weights(self, cause: str) -> None:
        """The update aborted while this rank slept: back to the published version. Level 1 restores its host copy;
        level 2 dropped the weights, so it reloads the published version through the verified path first."""
        if "weights" in self._asleep:
            self._wake(["weights"], cause)
        if self._sleep_level == 2:
            v = self.follower.state.policy_version
            self.engine.stage_weights(v, self._published_weights(v))
            self.engine.commit_weights(v)
        if "kv_cache" in self._asleep:
            self._wake(["kv_cache"], cause)

    def _published_weights(self, version: int) -> dict[str, torch.Tensor]:
        """The weights of a decided version, read back through the verified path (version 0: the initial weights)."""
        if version == 0:
            if self.initial_weights is None:
                raise RuntimeError(f"rank {self.rank} has no source for the initial weights")
            return dict(self.initial_weights())
        u = self.follower.state.updates[version]
        return dict(load_verified(u.uri, read_manifest(u.uri, expected_digest=u.manifest_digest)))

    def _stamp(self) -> tuple[int, str]:
        """The (policy version, weights digest) this rank stamps on its work: the engine's, unless it is lying."""
        return self._claim if self._claim is not None else (self.engine.policy_version, self.engine.weights_digest())

    def _resume(self, cause: str) -> None:
        was_paused = self.engine.is_paused
        if was_paused:
            self.engine.resume()
            self._emit(ev.EngineResumed(rank=self.rank), causation_id=cause)
        self._drained_for = None
        self._resume_when_closed = False
        self._set_serving(True)

    def _rejoin(self, cause: str) -> None:
        """Quarantined: stop serving, load the published version through the same verified path, rejoin."""
        self._set_serving(False)
        self._claim = None
        state = self.follower.state
        # the version to rejoin on: the newest one whose commit is decided (roll forward), else the published one
        committed = [
            v for v, u in state.updates.items() if u.status in ("committed", "invalidated", "healthy", "published")
        ]
        version = max([*committed, state.policy_version])
        try:
            self.engine.stage_weights(version, self._published_weights(version))
            report = self.engine.commit_weights(version)
        except Exception as exc:  # noqa: BLE001 - any failure is reported as an event; the rank fails closed
            self.logger.error("rejoin failed; rank stays quarantined", error=str(exc))
            return
        self._drained_for = None
        self._emit(
            ev.RankJoined(
                rank=self.rank,
                engine=self.engine.capabilities.name,
                policy_version=version,
                weights_digest=report.weights_digest,
                sleep_levels=self.engine.capabilities.sleep_levels,
                logprob_mode=self.engine.capabilities.logprob_mode,
            ),
            causation_id=cause,
        )
        if state.open_update is not None:  # generation stays stopped until the open transaction is closed
            self._resume_when_closed = True
        else:
            self._resume(cause)

    # ------------------------------------------------------------------ rollout thread
    def _start_rollout(self) -> None:
        self._rollout_incarnation += 1
        name = self.name if self._rollout_incarnation == 1 else f"{self.name}.{self._rollout_incarnation}"
        consumer = GroupConsumer(self.client, self.run_id, "rollout", name, claim_idle_ms=self.claim_idle_ms)
        consumer.ensure_group()
        self._rollout = threading.Thread(
            target=self._rollout_main, args=(consumer,), name=f"{name}-rollout", daemon=True
        )
        self._rollout.start()

    def _rollout_main(self, consumer: GroupConsumer) -> None:
        try:
            while not self.stop_event.is_set():
                for d in consumer.read(count=1, block_ms=100):
                    if not isinstance(d.event.payload, ev.GroupAdmitted):
                        consumer.ack(d.stream_id)
                        continue
                    if not self._generate_group(d, consumer):
                        return
        except WorkerKilled as exc:
            self.logger.warning("rollout thread killed by injection", reason=str(exc))
        except Exception:
            self.logger.exception("rollout thread crashed")

    def _wait_to_serve(self) -> bool:
        with self._gate:
            while not self._serving:
                if self.stop_event.is_set():
                    return False
                self._gate.wait(timeout=0.2)
            self._busy = True
            return True

    def _generate_group(self, d: Delivery, consumer: GroupConsumer) -> bool:
        p = d.event.payload
        assert isinstance(p, ev.GroupAdmitted)
        state = self.follower.state
        seen_by = time.monotonic() + 30.0
        while p.group_id not in state.groups:  # our follower may lag the consumer group by a few entries
            if self.stop_event.is_set():
                return False
            if time.monotonic() > seen_by:  # leave it pending: another consumer (or we, later) reclaims it
                self.logger.error("group never reached this rank's follower", group=p.group_id)
                return True
            time.sleep(0.01)  # the control thread is folding; this is a bounded wait on its progress
        g = state.groups[p.group_id]
        ids = [f"{p.group_id}/{i}" for i in range(p.n)]
        if g.samples:  # reclaimed from a dead worker: close what it left open, never run a sample twice
            orphans = [
                ev.SampleFailed(
                    sample_id=ids[s.index],
                    group_id=p.group_id,
                    index=s.index,
                    rank=self.rank,
                    error="worker lost before the sample finished",
                )
                for s in g.samples.values()
                if s.status == "started"
            ]
            self._emit(*orphans, causation_id=d.event.event_id)
            consumer.ack(d.stream_id)
            return True
        if g.status not in ("admitted", "generating"):  # closed before any sample started: nothing was dispatched
            consumer.ack(d.stream_id)
            return True
        if not self._wait_to_serve():
            return False
        try:
            if g.status not in ("admitted", "generating"):  # closed while we waited to serve: nothing dispatched
                consumer.ack(d.stream_id)
                return True
            version, digest = self._stamp()
            self._emit(
                *[
                    ev.SampleStarted(
                        sample_id=ids[i],
                        group_id=p.group_id,
                        index=i,
                        rank=self.rank,
                        policy_version=version,
                        weights_digest=digest,
                    )
                    for i in range(p.n)
                ],
                causation_id=d.event.event_id,
            )
            kill = self.injector.peek("kill-worker", worker="rollout")
            if kill is not None and self.groups_done + 1 >= kill.after:
                self.injector.take("kill-worker", worker="rollout")
                raise WorkerKilled(f"rollout on rank {self.rank} killed mid-group {p.group_id}")
            started = time.perf_counter()

            def should_cancel(_: int) -> bool:
                group = state.groups.get(p.group_id)
                return group is None or group.status not in ("admitted", "generating")

            streamed: set[int] = set()

            def on_sample(i: int, s: SampleOutput) -> None:
                # one sample ended: log it now, so a first-k group can complete while the others still run
                out_so_far = GroupOutput([], version, digest, self.engine_generation()[0], self.engine_generation()[1])
                t = self._trajectory(p, i, s, out_so_far)
                self._emit(
                    ev.SampleFinished(trajectory=t, answer=p.answer, gen_ms=(time.perf_counter() - started) * 1e3),
                    causation_id=d.event.event_id,
                )
                streamed.add(i)

            try:
                if self.engine.capabilities.streams_samples:
                    out = self.engine.generate(
                        p.prompt_token_ids, p.n, p.sampling, should_cancel=should_cancel, on_sample=on_sample
                    )  # type: ignore[call-arg]
                else:
                    out = self.engine.generate(p.prompt_token_ids, p.n, p.sampling, should_cancel=should_cancel)
            except Exception as exc:  # noqa: BLE001 - any failure is reported as an event; the rank fails closed
                self._emit(
                    *[
                        ev.SampleFailed(sample_id=ids[i], group_id=p.group_id, index=i, rank=self.rank, error=str(exc))
                        for i in range(p.n)
                    ],
                    causation_id=d.event.event_id,
                )
                consumer.ack(d.stream_id)
                return True
            gen_ms = (time.perf_counter() - started) * 1e3
            self._emit(*self._results(p, out, gen_ms, skip=streamed), causation_id=d.event.event_id)
            consumer.ack(d.stream_id)
            self.groups_done += 1
            return True
        finally:
            with self._gate:
                self._busy = False
                self._gate.notify_all()

    def engine_generation(self) -> tuple[int, int]:
        """(cache generation, graph generation) of the live engine, as stamped on trajectories."""
        return int(getattr(self.engine, "cache_generation", 0)), int(getattr(self.engine, "graph_generation", 0))

    def _results(self, p: ev.GroupAdmitted, out: GroupOutput, gen_ms: float, skip: set[int]) -> list[ev.Payload]:
        results: list[ev.Payload] = []
        for i, s in enumerate(out.samples):
            if i in skip:
                continue
            sid = f"{p.group_id}/{i}"
            if s.finish_reason == "abort":
                results.append(
                    ev.SampleCancelled(sample_id=sid, group_id=p.group_id, index=i, reason="cancelled while generating")
                )
                continue
            results.append(ev.SampleFinished(trajectory=self._trajectory(p, i, s, out), answer=p.answer, gen_ms=gen_ms))
        return results

    def _trajectory(self, p: ev.GroupAdmitted, i: int, s: SampleOutput, out: GroupOutput) -> Trajectory:
        start = len(p.prompt_token_ids)
        spans = tuple(
            VersionSpan(
                start=b,
                end=s.spans[k + 1][0] if k + 1 < len(s.spans) else len(s.token_ids),
                policy_version=v,
                weights_digest=d,
            )
            for k, (b, v, d) in enumerate(s.spans)
        )
        # a trajectory says the version it started on; its spans say which version produced which tokens
        version, digest = (
            (spans[0].policy_version, spans[0].weights_digest) if spans else (out.policy_version, out.weights_digest)
        )
        return Trajectory(
            trajectory_id=f"{p.group_id}/{i}",
            group_id=p.group_id,
            prompt_id=p.prompt_id,
            index=i,
            prompt_token_ids=p.prompt_token_ids,
            token_ids=s.token_ids,
            loss_mask=[1] * len(s.token_ids),
            positions=list(range(start, start + len(s.token_ids))),
            logprobs=s.logprobs,
            logprob_mode=self.engine.capabilities.logprob_mode,
            finish_reason=s.finish_reason,
            sampling=p.sampling,
            policy_version=self._claim[0] if self._claim else version,
            weights_digest=self._claim[1] if self._claim else digest,
            spans=spans,
            rank=self.rank,
            engine=self.engine.capabilities.name,
            cache_generation=out.cache_generation,
            graph_generation=out.graph_generation,
        )
