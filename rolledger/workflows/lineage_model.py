"""The lineage of one trajectory, as data: the links of its provenance chain, each naming the event that proves it,
and how the chain is shown (`to_json` for machines, `render` for people: a tree). Built by workflows.lineage."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any


class GroupFate(StrEnum):
    """How the trajectory's group ended, as far as the log goes."""

    COMPLETE = "complete"
    PARTIAL = "partial"
    CANCELLED = "cancelled"
    OPEN = "open"


class PolicySource(StrEnum):
    """Where a policy version's weights came from."""

    INITIAL = "initial"  # version 0: RunStarted's initial weights
    UPDATE = "update"  # a weight update that published it
    UNKNOWN = "unknown"  # no update in the log published it


@dataclass(frozen=True)
class SampleLink:
    sample_id: str
    started_event_id: str | None
    finished_event_id: str
    rank: int
    policy_version: int
    weights_digest: str
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int
    gen_ms: float


@dataclass(frozen=True)
class GroupLink:
    group_id: str
    prompt_id: str
    admitted_event_id: str | None
    n: int | None
    partial_policy: dict[str, Any] | None
    queued_bytes_at_admission: int | None
    outcome: GroupFate
    outcome_event_id: str | None
    accepted: bool  # this trajectory is among the group's accepted samples


@dataclass(frozen=True)
class PreparedRank:
    rank: int
    event_id: str
    manifest_digest: str
    staged_digest: str


@dataclass(frozen=True)
class AbortedAttempt:
    version: int
    event_id: str
    reason: str
    failed_ranks: tuple[int, ...]
    manifest_digest: str | None


@dataclass(frozen=True)
class PolicyLink:
    """Where the weights of one policy version came from."""

    version: int
    source: PolicySource
    weights_digest: str | None
    run_started_event_id: str | None = None  # version 0
    staged_event_id: str | None = None
    base_version: int | None = None
    manifest_digest: str | None = None
    uri: str | None = None
    bytes: int | None = None
    prepared: tuple[PreparedRank, ...] = ()
    committed_event_id: str | None = None
    committed_ranks: tuple[int, ...] = ()
    fence: int | None = None
    published_event_id: str | None = None
    published_ranks: tuple[int, ...] = ()
    aborted_attempts: tuple[AbortedAttempt, ...] = ()


@dataclass(frozen=True)
class RankLink:
    """The rank that generated the trajectory, as the log knew it when the sample started."""

    rank: int
    engine: str
    weights_digest: str
    rank_weights_event_id: str | None  # the RankCommitted / RankJoined that put these weights on the rank
    rank_weights_digest: str | None
    cache_generation: int
    cache_event_id: str | None  # the CacheInvalidated that created this generation
    graph_generation: int
    graph_event_id: str | None
    health_event_id: str | None
    rank_weights_cause_id: str | None = None  # the command those weights answered (its causation id)
    rank_weights_cause_type: str | None = None  # UpdateCommitted; RunStarted or RankQuarantined for a RankJoined


@dataclass(frozen=True)
class RewardLink:
    event_id: str
    reward: float
    correct: bool


@dataclass(frozen=True)
class ConsumptionLink:
    event_id: str
    step: int
    lag: int | None
    recorded_version: int | None
    train_step_event_id: str | None
    loss: float | None
    trainer: str = ""  # the producer of the BatchConsumed: the built-in trainer or an external one's name


@dataclass(frozen=True)
class DropLink:
    event_id: str
    reason: str
    lag: int


@dataclass(frozen=True)
class Lineage:
    trajectory_id: str
    run_id: str
    sample: SampleLink
    group: GroupLink
    sampling: dict[str, Any]
    sampling_matches_group: bool | None
    versions: tuple[int, ...]  # every version that produced a token, oldest first
    spans: tuple[dict[str, Any], ...]
    policies: tuple[PolicyLink, ...]  # one per version in `versions`
    rank: RankLink
    reward: RewardLink | None
    consumed: ConsumptionLink | None
    dropped: DropLink | None
    # an episode's turns (a task with an environment): start, end, source, began, ended, and the versions that
    # produced a policy turn's tokens; empty for a single completion
    turns: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def render(self) -> str:
        """A tree, one fact per line, each with the event id that proves it."""
        s, g, r = self.sample, self.group, self.rank
        out = [f"trajectory {self.trajectory_id} (run {self.run_id})"]

        def node(depth: int, text: str) -> None:
            out.append("  " * depth + "- " + text)

        node(
            0,
            f"sample {s.sample_id}: started {s.started_event_id or '?'}, finished {s.finished_event_id} "
            f"({s.finish_reason}, {s.prompt_tokens} prompt + {s.generated_tokens} generated tokens, {s.gen_ms:.1f} ms)",
        )
        node(
            0,
            f"group {g.group_id} (prompt {g.prompt_id}): admitted {g.admitted_event_id or '?'} n={g.n} "
            f"queued_bytes={g.queued_bytes_at_admission}; {g.outcome} {g.outcome_event_id or ''}".rstrip()
            + ("" if g.accepted else " - NOT accepted"),
        )
        if g.partial_policy is not None:
            node(1, f"partial policy {g.partial_policy}")
        note = "" if self.sampling_matches_group in (None, True) else " (DIFFERS from the group's)"
        node(0, "sampling " + ", ".join(f"{k}={v}" for k, v in self.sampling.items()) + note)
        node(0, f"policy version{'s' if len(self.versions) > 1 else ''} {', '.join(f'v{v}' for v in self.versions)}")
        for sp in self.spans:
            node(1, f"tokens [{sp['start']},{sp['end']}) by v{sp['policy_version']} ({sp['weights_digest']})")
        for p in self.policies:
            if p.source == PolicySource.INITIAL:
                node(1, f"v{p.version}: initial weights {p.weights_digest} (RunStarted {p.run_started_event_id})")
            elif p.source == PolicySource.UNKNOWN:
                node(1, f"v{p.version}: no update in the log published this version")
            else:
                node(1, f"v{p.version}: weights {p.weights_digest}")
                node(
                    2,
                    f"staged {p.staged_event_id or '?'}: manifest {p.manifest_digest} at {p.uri} "
                    f"({p.bytes} bytes, base v{p.base_version})",
                )
                for pr in p.prepared:
                    node(
                        2,
                        f"rank {pr.rank} prepared {pr.event_id} (manifest {pr.manifest_digest}, staged {pr.staged_digest})",
                    )
                node(2, f"committed {p.committed_event_id or '?'} on ranks {list(p.committed_ranks)} (fence {p.fence})")
                node(2, f"published {p.published_event_id or '?'} on ranks {list(p.published_ranks)}")
            for a in p.aborted_attempts:
                node(
                    2,
                    f"before it: update to v{a.version} aborted {a.event_id}: {a.reason} "
                    f"(failed ranks {list(a.failed_ranks)})",
                )
        if self.turns:
            policy = sum(1 for t in self.turns if t["source"] == "policy")
            node(
                0,
                f"episode: {len(self.turns)} turns ({policy} of the policy, {len(self.turns) - policy} of the environment)",
            )
        for k, t in enumerate(self.turns):
            took = f"{t['ended'] - t['began']:.3f} s"
            if t["source"] == "policy":
                by = ", ".join(f"v{v}" for v in t["versions"])
                node(1, f"turn {k}: policy, tokens [{t['start']},{t['end']}) by {by}, trained on ({took})")
            else:
                node(1, f"turn {k}: environment, tokens [{t['start']},{t['end']}), not trained on ({took})")
        node(0, f"rank {r.rank} ({r.engine}): weights {r.weights_digest}")
        node(1, f"rank weights from {r.rank_weights_event_id or '?'} ({r.rank_weights_digest})")
        if r.rank_weights_cause_id is not None:
            node(2, f"answering {r.rank_weights_cause_type or '?'} {r.rank_weights_cause_id}")
        node(1, f"cache generation {r.cache_generation} from {r.cache_event_id or 'start'}")
        node(1, f"graph generation {r.graph_generation} from {r.graph_event_id or 'start'}")
        node(1, f"health {r.health_event_id or '?'}")
        if self.reward is not None:
            node(0, f"reward {self.reward.reward} (correct={self.reward.correct}) {self.reward.event_id}")
        else:
            node(0, "reward: not scored")
        if self.consumed is not None:
            c = self.consumed
            loss = f", loss {c.loss:.4f} {c.train_step_event_id}" if c.loss is not None else ""
            by = f" by {c.trainer}" if c.trainer else ""
            node(0, f"consumed{by} at trainer step {c.step} with lag {c.lag} {c.event_id}{loss}")
        elif self.dropped is not None:
            node(0, f"dropped ({self.dropped.reason}, lag {self.dropped.lag}) {self.dropped.event_id}")
        else:
            node(0, "not consumed (yet)")
        return "\n".join(out)
