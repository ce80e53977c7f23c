"""The admission controller: `decide_admission(state, inputs) -> [payloads]`, pure.

Three gates, each a pause reason the controller owns (the update and handoff coordinators own theirs):
- bytes: completed-but-untrained bytes (each finished sample's encoded trajectory, `SampleFinished.nbytes`) plus the
  bytes the groups in flight and the new group may hold (each sample reserved the encoded size of the largest
  trajectory it may finish with, `sample_reserve`: an upper bound, not an estimate, which the rank enforces) must stay
  within `admission.max_queued_bytes`: admission stops *before* the queue could outgrow its cap, however long the
  generations run.
- lag: a group admitted now is consumed around trainer step floor(C / groups_per_step) + 1, C the groups admitted
  before it and not cancelled or dropped. Admission stops when that step lies more than `admission.max_lag` steps
  beyond the trainer's *settled progress* (`settled_version`): the newest version whose update transaction has
  closed, published or aborted (never less than the published version). Versions are numbered by trainer steps (one
  staged per step, a number never reused), so this counts how far generation runs ahead of the trainer, in steps.
  Why not against the published version: an aborted update never advances it, while every step still consumes
  groups; after max_lag + 1 aborts every group the trainer needs next would count as "too far ahead", nothing would
  be admitted, the trainer would wait for groups and no update would come - a hang. Against settled progress every
  closed update, committed or not, moves the horizon one step, and the groups of the trainer's next step are always
  within it (their consumption step is settled + 1, lag 0), so the gate can never hold back the work the trainer
  needs: it only bounds how far generation runs ahead. Staleness stays bounded all the same: the trainer drops a
  group whose published-version lag exceeds max_lag when it plans a step (workflows/trainer.py, the second check),
  so after an abort a few groups may be generated and then dropped (they are replaced), never trained on. In a run
  without aborts the settled version is the published one and the rule is the one AReaL uses, counted in groups.
- rate: generation is throttled to the trainer's measured drain rate (`throttle_cap`). By Little's law the groups
  in flight are the admission rate times a group's generation latency W; for a batch to be ready each time the
  trainer finishes a step (its busy time T: training, then the update until it closes, never the time it waited for
  data, which would feed the throttle's own starvation back into it), groups ahead of the trainer (completed or in
  flight, untrained) are held to one batch being trained on plus ceil(W / T) batches in flight: `groups_per_step` x
  (1 + ceil(W / T)), the second factor between 1 and max_lag + 1 (beyond it the lag gate closes first). W and T are
  moving averages of wall times in the log (`AdmissionState.gen_latency_s`, `step_busy_s`), so a replay decides
  alike; before both are measured the cap is two batches.
Transitions only: AdmissionPaused when a gate closes, AdmissionResumed when it opens; while every gate is open,
GroupAdmitted for the next prompts up to `max_inflight_groups`, in the order workflows/scheduler.py picks them.

Cost: O(open work). One scan of the live groups per decision (`live_totals`; retired ones are terminal and count
through `admission.gone_before_training`), whatever the number of groups it admits, and the candidates are the
`window` prompts from the scheduler's frontier.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig, SamplingParams, TaskConfig
from rolledger.schemas.statuses import AdmissionReason, RunStatus
from rolledger.schemas.trajectory import SPANS_RESERVED, reserved_nbytes
from rolledger.workflows.scheduler import PromptItem, candidates, est_completion_tokens, pick_next
from rolledger.workflows.state import RunState

OWNED_REASONS: tuple[AdmissionReason, ...] = (AdmissionReason.BYTES, AdmissionReason.LAG, AdmissionReason.RATE)


@dataclass(frozen=True)
class AdmissionInputs:
    """What the controller needs beyond the state, supplied by the edge (the clock, the dataset)."""

    now: float
    prompts: Sequence[PromptItem]  # the run's prompt sequence (cycled by index)
    window: int = 16  # how many not-yet-admitted prompts the scheduler chooses among


def sample_reserve(
    group_id: str,
    item: PromptItem,
    n: int,
    sampling: SamplingParams,
    spans: bool,
    episode: TaskConfig | None = None,
) -> int:
    """The bytes reserved for each sample of a group: the encoded size of the largest trajectory it may finish with
    (`reserved_nbytes`: every array at `max_tokens`, or for an `episode` - a task with an environment - at its
    `max_episode_tokens` with a turn record for each of its turns, the policy's and the environment's; version spans
    only where a sample may carry them: an interruptible run, or one that recycles aborted samples). The rank fails
    a sample that encodes larger (workers/roles/rollout.py), so completed groups never hold more than was
    reserved."""
    spans_reserved = SPANS_RESERVED if spans else 0
    if episode is None or episode.env is None:
        return reserved_nbytes(group_id, item.prompt_id, len(item.token_ids), n, sampling, spans_reserved)
    return reserved_nbytes(
        group_id,
        item.prompt_id,
        len(item.token_ids),
        n,
        sampling,
        spans_reserved,
        width=episode.max_episode_tokens,
        turns=2 * episode.max_turns,  # each policy turn and the environment's reply to it
    )


@dataclass(frozen=True)
class Gates:
    """Each gate's verdict for admitting `extra_groups` more groups holding `extra_bytes`, and why."""

    bytes_ok: bool
    lag_ok: bool
    rate_ok: bool
    projected_bytes: int
    projected_lag: int
    untrained: int
    rate_cap: int

    def verdicts(self, cfg: RunConfig) -> list[tuple[AdmissionReason, bool, str]]:
        adm = cfg.admission
        return [
            (
                AdmissionReason.BYTES,
                self.bytes_ok,
                f"projected {self.projected_bytes} B > cap {adm.max_queued_bytes} B",
            ),
            (AdmissionReason.LAG, self.lag_ok, f"projected lag {self.projected_lag} > cap {adm.max_lag}"),
            (
                AdmissionReason.RATE,
                self.rate_ok,
                f"{self.untrained} groups ahead of the trainer (cap {self.rate_cap})",
            ),
        ]


def settled_version(state: RunState) -> int:
    """The trainer's settled progress: the newest version whose update closed (published or aborted), at least the
    published version. The lag gate measures the admission horizon against it (see the module docstring)."""
    closed = [v for v, u in state.updates.items() if not u.open]
    return max([state.policy_version, *closed])


@dataclass(frozen=True, slots=True)
class LiveTotals:
    """What the live groups hold: the bytes the open ones reserved, and how many are untrained."""

    inflight_bytes: int
    untrained: int


def live_totals(state: RunState) -> LiveTotals:
    """One scan of the live groups: O(open work). A decision sums them once and asks the gates for each group it
    admits on the same totals (the groups it admits count as `extra_groups`)."""
    inflight_bytes = untrained = 0
    for g in state.groups.values():
        if g.status.is_open:
            inflight_bytes += g.est_bytes
        if g.untrained:
            untrained += 1
    return LiveTotals(inflight_bytes, untrained)


def gates(
    state: RunState, cfg: RunConfig, extra_groups: int, extra_bytes: int, live: LiveTotals | None = None
) -> Gates:
    """The three gates, as if `extra_groups` more groups of `extra_bytes` in all were admitted now. `live`: the
    state's `live_totals`, when the caller has them."""
    adm = cfg.admission
    totals = live if live is not None else live_totals(state)
    untrained = totals.untrained
    projected_bytes = state.admission.queued_bytes + totals.inflight_bytes + extra_bytes
    # every group ever admitted but those cancelled or dropped (consumed ones included: they set the trainer's pace)
    counted = state.admission.admitted - state.admission.gone_before_training + extra_groups
    projected_lag = (counted - 1) // cfg.trainer.groups_per_step - settled_version(state) if counted else 0
    untrained += extra_groups
    cap = throttle_cap(state, cfg)
    return Gates(
        bytes_ok=projected_bytes <= adm.max_queued_bytes,
        lag_ok=projected_lag <= adm.max_lag,
        rate_ok=not adm.throttle_to_drain_rate or untrained <= cap,
        projected_bytes=projected_bytes,
        projected_lag=projected_lag,
        untrained=untrained,
        rate_cap=cap,
    )


def throttle_cap(state: RunState, cfg: RunConfig) -> int:
    """The rate gate's cap on untrained groups: `groups_per_step` x (1 + batches in flight), batches in flight =
    ceil(generation latency / trainer step busy time) within [1, max_lag + 1] (module docstring)."""
    adm = state.admission
    in_flight = 1
    if adm.gen_latency_s > 0.0 and adm.step_busy_s > 0.0:
        in_flight = min(max(math.ceil(adm.gen_latency_s / adm.step_busy_s), 1), cfg.admission.max_lag + 1)
    return cfg.trainer.groups_per_step * (1 + in_flight)


def throttle_bound(cfg: RunConfig) -> int | None:
    """The most `throttle_cap` can ever be (None without the throttle)."""
    if not cfg.admission.throttle_to_drain_rate:
        return None
    return cfg.trainer.groups_per_step * (cfg.admission.max_lag + 2)


def decide_admission(state: RunState, inputs: AdmissionInputs) -> list[ev.Payload]:
    cfg = state.config
    if cfg is None or state.status != RunStatus.RUNNING or not inputs.prompts:
        return []
    n = cfg.group_size
    pool = candidates(state.scheduler, inputs.prompts, inputs.window)
    admitted_now: list[int] = []  # prompt indices admitted by this decision, in order

    out: list[ev.Payload] = []
    paused = list(state.admission.paused)
    live = live_totals(state)  # once per decision, not once per group admitted
    # Pause/resume on the owned gates as they stand for the next group.
    first = pick_next(state, cfg, pool, admitted_now)
    first_bytes = group_bytes(cfg, first, state.admission.admitted) if first else 0
    for reason, ok, detail in gates(state, cfg, 1, first_bytes, live).verdicts(cfg):
        if not ok and reason not in paused:
            out.append(
                ev.AdmissionPaused(
                    reason=reason, queued_bytes=state.admission.queued_bytes, lag=state.lag, detail=detail
                )
            )
            paused.append(reason)
        elif ok and reason in paused:
            out.append(ev.AdmissionResumed(reason=reason))
            paused.remove(reason)
    if paused:
        return out
    # Admit in scheduler order while every gate stays open and the in-flight cap allows.
    admitted_bytes = 0
    seq = state.admission.admitted  # group ids number the admissions
    while (item := pick_next(state, cfg, pool, admitted_now)) is not None:
        if state.admission.inflight + len(admitted_now) >= cfg.admission.max_inflight_groups:
            break
        nbytes = group_bytes(cfg, item, seq + len(admitted_now))
        g = gates(state, cfg, len(admitted_now) + 1, admitted_bytes + nbytes, live)
        if not (g.bytes_ok and g.lag_ok and g.rate_ok):
            break  # the next tick pauses on the gate that closed
        out.append(
            ev.GroupAdmitted(
                group_id=group_name(seq + len(admitted_now)),
                prompt_id=item.prompt_id,
                prompt_index=item.index,
                prompt_token_ids=list(item.token_ids),
                n=n,
                sampling=group_sampling(cfg, seq + len(admitted_now)),
                partial_policy=cfg.partial_policy,
                answer=item.answer,
                est_remaining_tokens=est_completion_tokens(state, cfg, item.prompt_id, len(item.token_ids)) * n,
                est_bytes=nbytes,
                queued_bytes=g.projected_bytes,
                byte_cap=cfg.admission.max_queued_bytes,
                deadline=inputs.now + cfg.partial_policy.deadline_s if cfg.partial_policy.deadline_s else None,
            )
        )
        admitted_now.append(item.index)
        pool.remove(item)
        admitted_bytes += nbytes
    return out


def group_bytes(cfg: RunConfig, item: PromptItem, seq: int) -> int:
    """What the group admitted `seq`-th, of `item`, may hold once completed: `sample_reserve` for each of its samples,
    so the groups in flight can never complete over the byte cap, whatever they generate."""
    n = cfg.group_size
    spans = cfg.interruptible or cfg.recycle_aborted  # a sample may carry version spans
    return n * sample_reserve(group_name(seq), item, n, group_sampling(cfg, seq), spans, cfg.task)


def group_name(seq: int) -> str:
    """The id of the group admitted `seq`-th (group ids number the admissions)."""
    return f"g{seq:06d}"


def group_sampling(cfg: RunConfig, group_index: int) -> SamplingParams:
    """The run's sampling settings with a per-group seed derived from the run's seed (unless the config fixes one):
    the same weights and group give the same samples, and the trajectory records exactly how it was drawn."""
    if cfg.sampling.seed is not None:
        return cfg.sampling
    return cfg.sampling.model_copy(update={"seed": (cfg.seed * 1_000_003 + group_index) % 2**31})
