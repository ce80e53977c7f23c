"""The reward worker: scores every finished sample with the task's checker (SampleFinished -> SampleScored).

Stateless apart from a follower used to skip samples already scored (a reclaimed entry is never scored twice).
The answer travels in SampleFinished, so no lookup is needed. Faults wrap `scorer` (workers/faults.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis

from rolledger.events.consumer import GroupConsumer
from rolledger.schemas import events as ev
from rolledger.schemas.statuses import SampleStatus
from rolledger.workers.runtime import Follower, Worker
from rolledger.workers.tasks import score


class RewardWorker(Worker):
    kind = "reward"

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        name: str,
        tokenizer: Any,
        *,
        claim_idle_ms: int | None = None,
    ) -> None:
        super().__init__(client, run_id, name)
        self.tokenizer = tokenizer
        # the finished samples of one read -> their scores; a fault wrapper may replace it
        self.scorer: Callable[[Sequence[ev.SampleFinished]], Sequence[ev.SampleScored]] = self.score_samples
        self.claim_idle_ms = claim_idle_ms  # None: the run's recovery.lost_after_s, once its config is folded
        self.consumer = GroupConsumer(
            client, run_id, "reward", name, claim_idle_ms=claim_idle_ms if claim_idle_ms is not None else 30_000
        )
        self.follower = Follower(self.log)
        self.scored = 0

    def respawn(self) -> RewardWorker:
        return RewardWorker(
            self.client,
            self.run_id,
            self.next_name(),
            self.tokenizer,
            claim_idle_ms=self.claim_idle_ms,
        )

    def completion_text(self, token_ids: list[int]) -> str:
        eos = self.tokenizer.eos_token_id
        if eos in token_ids:
            token_ids = token_ids[: token_ids.index(eos)]
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def run(self) -> None:
        self.consumer.ensure_group()
        while not self.stop_event.is_set():
            deliveries = self.consumer.read(count=64, block_ms=100)
            if not deliveries:
                if self.follower.state.status.is_terminal:
                    break
                self.follower.catch_up()
                continue
            self.follower.catch_up()
            cfg = self.follower.state.config
            if self.claim_idle_ms is None and cfg is not None:
                self.consumer.claim_idle_ms = cfg.recovery.lost_after_ms
            finished = [
                p
                for p in (d.event.payload for d in deliveries)
                if isinstance(p, ev.SampleFinished) and not self._already_scored(p)
            ]
            out = self.scorer(finished) if finished else []
            self.emitter.emit(out, policy_version=self.follower.state.policy_version)
            self.consumer.ack(*(d.stream_id for d in deliveries))
            self.scored += len(out)

    def score_samples(self, finished: Sequence[ev.SampleFinished]) -> list[ev.SampleScored]:
        """The task's checker on each sample's completion (up to <eos>) against its answer."""
        out = []
        for p in finished:
            t = p.trajectory
            reward = score(self.completion_text(list(t.token_ids)), p.answer)
            out.append(
                ev.SampleScored(sample_id=t.trajectory_id, group_id=t.group_id, reward=reward, correct=reward >= 1.0)
            )
        return out

    def _already_scored(self, p: ev.SampleFinished) -> bool:
        """Scored already, or not finished in the log (a late result of a rank that lost the sample's group)."""
        g = self.follower.state.groups.get(p.trajectory.group_id)
        smp = g.samples.get(p.trajectory.index) if g else None
        return smp is not None and (smp.reward is not None or smp.status != SampleStatus.FINISHED)
