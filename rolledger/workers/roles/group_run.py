"""Generating one group a rollout slot took (workers/roles/rollout.py): its samples' SampleStarted, the group's
engine request, the terminal event of each sample (streamed as each ends where the group may close early, else in
one append), the samples an update's drain cut continued where the run recycles them (`recycle_aborted`, or a
request an interruptible run's drain refused), and, for a task with an environment, each sample's episode after
its first turn (workers/roles/episodes.py). The engine failing fails every sample not yet logged (the rank fails
closed); an injected WorkerKilled or a lost claim ends the slot without acknowledging the group.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from rolledger.events.consumer import Delivery
from rolledger.schemas import events as ev
from rolledger.schemas.statuses import PolicyKind
from rolledger.workers.engines.protocol import GroupOutput, IllegalEngineOrder, SampleOutput, StaleRequest
from rolledger.workers.roles.claims import Claim, ClaimLost
from rolledger.workers.roles.episodes import run_group_episodes
from rolledger.workers.roles.sample_events import finished_event, results, trajectory_of
from rolledger.workers.runtime.runtime import Emitter, WorkerKilled

if TYPE_CHECKING:
    from rolledger.workers.roles.rollout import Rollout


def run_group(
    r: Rollout,
    d: Delivery,
    p: ev.GroupAdmitted,
    claim: Claim,
    emitter: Emitter,
    announce: Callable[[], None],
    release: Callable[[int], None] | None = None,
) -> None:
    engine, rank = r.w.engine, r.w.rank
    ids = [f"{p.group_id}/{i}" for i in range(p.n)]
    version, digest = engine.policy_version, engine.weights_digest()

    def emit(*payloads: ev.Payload) -> None:
        claim.check()  # still ours? (a reclaimed group gets nothing more from this rank)
        emitter.emit(list(payloads), policy_version=engine.policy_version, causation_id=d.event.event_id)

    emit(
        *[
            ev.SampleStarted(
                sample_id=ids[i],
                group_id=p.group_id,
                index=i,
                rank=rank,
                policy_version=version,
                weights_digest=digest,
            )
            for i in range(p.n)
        ]
    )
    announce()
    started = time.perf_counter()

    def should_cancel(_: int) -> bool:
        if claim.lost.is_set():
            return True
        with r.w.lock:
            return not r._open(p.group_id)

    streamed: set[int] = set()
    refused = False  # by an engine paused or already serving a newer version: cut before the first token

    close_early = may_close_early(p)
    with r.w.lock:
        cfg = r.w.state.config
    episodic = cfg is not None and cfg.task.env is not None  # every sample an episode (workers/roles/episodes.py)

    def on_sample(i: int, s: SampleOutput) -> None:
        if release is not None:
            release(i)  # its sequence's room is free: another slot may take a group now
        if not close_early:
            return  # logged with the group, in one append
        # one sample ended: log it now, so a first-k group can complete while the others still run
        so_far = GroupOutput([], version, digest, engine.cache_generation, engine.graph_generation)
        emit(finished_event(r, p, trajectory_of(r, p, i, s, so_far), (time.perf_counter() - started) * 1e3))
        streamed.add(i)

    def fail_open(exc: Exception) -> None:
        """The engine failed: every sample not yet logged as finished fails (the rank fails closed)."""
        emit(
            *[
                ev.SampleFailed(sample_id=ids[i], group_id=p.group_id, index=i, rank=rank, error=str(exc))
                for i in range(p.n)
                if i not in streamed  # a sample already logged as finished has its terminal event
            ]
        )

    try:
        # expect_version: the samples are logged as started on `version`; a whole update (a keep drain needs
        # only that SampleStarted be in the log) may commit before the request reaches the engine, which then
        # refuses it (StaleRequest) rather than run it on weights its stamp does not name
        began = time.time()
        if engine.capabilities.streams_samples and (close_early or release is not None) and not episodic:
            out = engine.generate(
                p.prompt_token_ids,
                p.n,
                p.sampling,
                should_cancel=should_cancel,
                on_sample=on_sample,  # type: ignore[call-arg]  # streaming engines (capabilities.streams_samples)
                expect_version=version,
            )
        else:  # the group completes only once every sample ended: one append for all of them
            out = engine.generate(
                p.prompt_token_ids, p.n, p.sampling, should_cancel=should_cancel, expect_version=version
            )
    except (WorkerKilled, ClaimLost):
        raise
    except IllegalEngineOrder as exc:
        if not (engine.is_paused or isinstance(exc, StaleRequest)):
            fail_open(exc)
            return
        refused = True
        # a drain paused the engine, or a whole update committed, between this group's start and its request:
        # every sample is cut before its first token, as that pause would have cut it (recycled or cancelled
        # below, not failed); recycled, each says its start version in an empty first span
        out = GroupOutput(
            [SampleOutput([], [], "abort") for _ in range(p.n)],
            version,
            digest,
            engine.cache_generation,
            engine.graph_generation,
        )
    except Exception as exc:  # noqa: BLE001 - any failure is reported as an event; the rank fails closed
        fail_open(exc)
        return
    # a sample without spans ran on one version: the one the group started on (its SampleStarted stamp), not the
    # one serving when the group ended (an interruptible group spans a commit; its early samples ended before it)
    started_on = GroupOutput(out.samples, version, digest, out.cache_generation, out.graph_generation)
    # refused in an interruptible run: continued on what serves next, as a sample the drain parked would be
    if cfg is not None and (cfg.recycle_aborted or (refused and cfg.interruptible)):
        try:
            started_on = _recycle(r, p, started_on, claim, should_cancel, skip=streamed)
        except (WorkerKilled, ClaimLost):
            raise
        except Exception as exc:  # noqa: BLE001 - as above
            fail_open(exc)
            return
    if episodic:  # each sample goes on from its first turn, its environment and the policy taking turns
        assert cfg is not None
        first_ended = time.time()
        try:
            ended_all = run_group_episodes(
                r,
                p,
                started_on,
                cfg,
                claim,
                should_cancel,
                emit,
                release,
                close_early,
                (began, first_ended),
                started,
            )
        except (WorkerKilled, ClaimLost):
            raise
        except Exception as exc:  # noqa: BLE001 - as above
            fail_open(exc)
            return
        emit(*ended_all)
        return
    gen_ms = (time.perf_counter() - started) * 1e3
    emit(*results(r, p, started_on, gen_ms, skip=streamed))


# ---------------------------------------------------------------- recycling aborted samples


def _recycle(
    r: Rollout,
    p: ev.GroupAdmitted,
    out: GroupOutput,
    claim: Claim,
    should_cancel: Callable[[int], bool],
    skip: set[int],
) -> GroupOutput:
    """`recycle_aborted`: every sample an abort drain cut short is continued from its own tokens once this rank
    serves again (the update committed or aborted), until none is cut or the group may not
    go on (closed, reclaimed, the rank stopping): those end as they are (cancelled, sample_events.results). Each stretch of
    tokens keeps the version that produced it (spans)."""
    samples = dict(enumerate(out.samples))
    while cut := [i for i, s in samples.items() if s.finish_reason == "abort" and i not in skip]:
        if not _wait_to_continue(r, p, claim):
            break
        samples.update(_continue_all(r, p, {i: samples[i] for i in cut}, out, should_cancel))
    return GroupOutput(
        [samples[i] for i in range(len(out.samples))],
        out.policy_version,
        out.weights_digest,
        out.cache_generation,
        out.graph_generation,
    )


def _continue_all(
    r: Rollout,
    p: ev.GroupAdmitted,
    cut: dict[int, SampleOutput],
    out: GroupOutput,
    should_cancel: Callable[[int], bool],
) -> dict[int, SampleOutput]:
    """The cut samples continued at once, each its own engine request (the engine batches them as it batches
    the slots' groups): one after the other they would take the sum of their times, and the next drain could cut
    them again before the last one started. A sample whose request the engine refused because it was paused again
    (the next drain, between the wait and the call) is left out: it stays cut and waits for the next turn."""
    name = threading.current_thread().name
    with ThreadPoolExecutor(max_workers=len(cut), thread_name_prefix=f"{name}-recycle") as pool:
        futures = {i: pool.submit(_continued, r, p, i, s, out, should_cancel) for i, s in cut.items()}
    continued: dict[int, SampleOutput] = {}
    for i, f in futures.items():
        try:
            continued[i] = f.result()
        except IllegalEngineOrder:
            pass
    return continued


def _wait_to_continue(r: Rollout, p: ev.GroupAdmitted, claim: Claim) -> bool:
    """Wait until this rank may generate again (as a group's start does, `_admit`); False when the group may not
    go on. The slot does not count as running meanwhile: the drain it waits out needs none running."""
    with r.w.lock:
        r.w.running -= 1
        r.w.lock.notify_all()
        try:
            while not (r.w.stop_event.is_set() or claim.lost.is_set() or not r._open(p.group_id)):
                if r._may_generate() and not r.w.engine.is_paused:
                    return True
                r.w.lock.wait(timeout=0.2)  # woken by every fold of the control thread
            return False
        finally:
            r.w.running += 1


def _continued(
    r: Rollout, p: ev.GroupAdmitted, i: int, s: SampleOutput, out: GroupOutput, should_cancel: Callable[[int], bool]
) -> SampleOutput:
    """Sample `i`, cut after its k tokens, continued from them by the engine as it serves now: the tokens and
    logprobs of both stretches, the continuation's finish reason, and a span per version (none: one version)."""
    k = len(s.token_ids)
    seed = None if p.sampling.seed is None else (p.sampling.seed * 1_000_003 + i * 65_537 + k) % 2**31
    sampling = p.sampling.model_copy(update={"max_tokens": p.sampling.max_tokens - k, "seed": seed})
    more = r.w.engine.generate([*p.prompt_token_ids, *s.token_ids], 1, sampling, should_cancel=should_cancel)
    c = more.samples[0]
    before = s.spans or ((0, out.policy_version, out.weights_digest),)
    after = c.spans or ((0, more.policy_version, more.weights_digest),)
    spans: list[tuple[int, int, str]] = []
    for start, version, digest in [*before, *((k + b, v, d) for b, v, d in after)]:
        if not spans or spans[-1][1:] != (version, digest):  # the same weights on both sides: one stretch
            spans.append((start, version, digest))
    return SampleOutput(
        token_ids=[*s.token_ids, *c.token_ids],
        logprobs=[*s.logprobs, *c.logprobs],
        finish_reason=c.finish_reason,
        spans=tuple(spans) if len(spans) > 1 else (),
    )


def may_close_early(p: ev.GroupAdmitted) -> bool:
    """Can the group complete before all its samples end? First k completes at the k-th, a deadline cuts it with the
    samples finished by then: their samples are logged as each ends (streamed). Otherwise a group completes only when
    every sample ended, and streaming would cost an append per sample for nothing."""
    return p.partial_policy.kind == PolicyKind.FIRST_K or p.deadline is not None
