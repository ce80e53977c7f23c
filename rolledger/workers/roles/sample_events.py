"""A finished group's samples as events: the trajectory of each (its tokens, masks, logprobs and their mode, the
version spans and an episode's turns, the rank's cache and graph generations), SampleFinished with its encoded
size, or SampleFailed when it encodes over what its group reserved, and SampleCancelled for a sample cut short.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from rolledger.events.measured import measure
from rolledger.schemas import events as ev
from rolledger.schemas.config import SamplingParams
from rolledger.schemas.trajectory import Trajectory, Turn, VersionSpan
from rolledger.workers.engines.protocol import EngineCapabilities, GroupOutput, SampleOutput

if TYPE_CHECKING:
    from rolledger.workers.roles.rollout import Rollout


def results(r: Rollout, p: ev.GroupAdmitted, out: GroupOutput, gen_ms: float, skip: set[int]) -> list[ev.Payload]:
    results: list[ev.Payload] = []
    for i, s in enumerate(out.samples):
        if i in skip:
            continue
        sid = f"{p.group_id}/{i}"
        if s.finish_reason == "abort":
            results.append(
                ev.SampleCancelled(
                    sample_id=sid,
                    group_id=p.group_id,
                    index=i,
                    reason="cancelled while generating",
                    tokens=len(s.token_ids),
                )
            )
            continue
        results.append(finished_event(r, p, trajectory_of(r, p, i, s, out), gen_ms))
    return results


def finished_event(r: Rollout, p: ev.GroupAdmitted, t: Trajectory, gen_ms: float) -> ev.Payload:
    """A finished sample's event, with its encoded size; a sample that encodes larger than its group reserved
    per sample at admission (`GroupAdmitted.est_bytes`, workflows/admission.sample_reserve) fails instead, so the
    completed groups never hold more bytes than admission counted."""
    nbytes = measure(t)  # its bytes kept: the SampleFinished is written from them (events/measured.py)
    reserve = p.est_bytes // p.n
    if nbytes > reserve:
        error = f"its trajectory encodes to {nbytes} B, over the {reserve} B reserved per sample at admission"
        return ev.SampleFailed(sample_id=t.trajectory_id, group_id=p.group_id, index=t.index, rank=t.rank, error=error)
    return ev.SampleFinished(trajectory=t, answer=p.answer, gen_ms=gen_ms, nbytes=nbytes)


def trajectory_of(
    r: Rollout,
    p: ev.GroupAdmitted,
    i: int,
    s: SampleOutput,
    out: GroupOutput,
    *,
    loss_mask: list[int] | None = None,
    turns: tuple[Turn, ...] = (),
) -> Trajectory:
    start = len(p.prompt_token_ids)
    spans = tuple(
        VersionSpan(
            start=b,
            end=s.spans[k + 1][0] if k + 1 < len(s.spans) else len(s.token_ids),
            policy_version=v,
            weights_digest=dg,
        )
        for k, (b, v, dg) in enumerate(s.spans)
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
        loss_mask=[1] * len(s.token_ids) if loss_mask is None else loss_mask,
        positions=list(range(start, start + len(s.token_ids))),
        logprobs=s.logprobs,
        logprob_mode=logprob_mode_of(r.w.engine.capabilities, p.sampling),
        finish_reason=s.finish_reason,
        sampling=p.sampling,
        policy_version=version,
        weights_digest=digest,
        spans=spans,
        rank=r.w.rank,
        engine=r.w.engine.capabilities.name,
        cache_generation=out.cache_generation,
        graph_generation=out.graph_generation,
        turns=turns,
    )


def logprob_mode_of(caps: EngineCapabilities, sampling: SamplingParams) -> Literal["raw", "processed"]:
    """The mode a sample's logprobs are in: the request's where the engine honours it per request (torch), else the
    engine's (vLLM: a server setting). Stamped on the trajectory; the trainer's agreement compares in that mode."""
    if caps.logprob_mode_per_request:
        return "processed" if sampling.logprob_mode == "processed" else "raw"
    return caps.logprob_mode
