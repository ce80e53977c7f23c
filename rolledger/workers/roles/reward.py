"""The reward worker: scores every finished sample with the task's reward functions (SampleFinished -> SampleScored,
or SampleFailed with stage "reward" naming the function when they cannot score it).

Stateless apart from a follower used to skip samples already scored (a reclaimed entry is never scored twice; the
process's one fold, shared with its ranks, `runtime.shared_follower`: read under its lock), and the task it loads
once the run's config is folded: the prompts by id (their rows are the reward functions' columns)
and the functions imported from their paths (workers/policy/rewards.py, workers/policy/task_plugins.py). Each read's finished
samples are scored as one batch. An episode (a task with an environment) is scored on its final answer, the text of
the policy's last turn (`answer_tokens`). Faults wrap `scorer` (workers/operator/faults.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis

from rolledger.events.consumer import GroupConsumer
from rolledger.schemas import events as ev
from rolledger.schemas.statuses import SampleStatus
from rolledger.schemas.trajectory import Trajectory
from rolledger.workers.policy.rewards import Rewards, resolve
from rolledger.workers.policy.task_plugins import load_prompts
from rolledger.workers.policy.tasks import Prompt
from rolledger.workers.runtime.runtime import Worker, shared_follower
from rolledger.workflows.replay import position
from rolledger.workflows.scheduler import dataset_prompt_id


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
        self.scorer: Callable[[Sequence[ev.SampleFinished]], Sequence[ev.SampleScored | ev.SampleFailed]] = (
            self.score_samples
        )
        self.task: tuple[dict[str, Prompt], Rewards] | None = None  # loaded from the run's config on first use
        self.claim_idle_ms = claim_idle_ms  # None: the run's recovery.lost_after_s, once its config is folded
        self.consumer = GroupConsumer.work(
            client, run_id, "reward", name, claim_idle_ms=claim_idle_ms if claim_idle_ms is not None else 30_000
        )
        self.follower = shared_follower(self.log)
        self.lock = self.follower.lock
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
            deliveries = self.consumer.read(count=16, block_ms=100)  # entries: an append's samples each
            if not deliveries:
                if self.follower.state.status.is_terminal:
                    break
                self.follower.poll(block_ms=10)  # what the log brought meanwhile (the run's end)
                continue
            # the delivered samples and this worker's own scores (a redelivered sample it scored is skipped)
            self.follower.catch_up(through=max([*(d.log_id for d in deliveries), self.emitter.last_id], key=position))
            cfg = self.follower.state.config
            if self.claim_idle_ms is None and cfg is not None:
                self.consumer.claim_idle_ms = cfg.recovery.lost_after_ms
            with self.lock:
                finished = [
                    p
                    for p in (d.event.payload for d in deliveries)
                    if isinstance(p, ev.SampleFinished) and not self._already_scored(p)
                ]
            out = self.scorer(finished) if finished else []
            self.emitter.emit(out, policy_version=self.follower.state.policy_version)
            self.consumer.ack(*(d.stream_id for d in deliveries))
            self.scored += len(out)

    def load_task(self) -> tuple[dict[str, Prompt], Rewards]:
        """The run's prompts by id and its reward functions (from the folded config; loaded once)."""
        if self.task is None:
            cfg = self.follower.state.config
            if cfg is None:
                raise RuntimeError("the reward worker scored before the run's config was folded")
            self.task = {p.prompt_id: p for p in load_prompts(cfg.task, cfg.seed)}, resolve(cfg.task)
        return self.task

    def score_samples(self, finished: Sequence[ev.SampleFinished]) -> list[ev.SampleScored | ev.SampleFailed]:
        """The reward functions on the samples' completions (each up to <eos>) with their prompts' rows: a score per
        sample, or SampleFailed naming the function that could not score it."""
        prompts, rewards = self.load_task()
        ids = [dataset_prompt_id(p.trajectory.prompt_id) for p in finished]
        known = [i for i, pid in enumerate(ids) if pid in prompts]
        texts = [self.completion_text(answer_tokens(finished[i].trajectory)) for i in known]
        rows = [prompts[ids[i]] for i in known]
        results = dict(zip(known, rewards.score(texts, rows), strict=True))
        out: list[ev.SampleScored | ev.SampleFailed] = []
        for i, p in enumerate(finished):
            t = p.trajectory
            got = results.get(i, f"prompt {t.prompt_id!r} is not in the run's task")
            if isinstance(got, str):
                out.append(
                    ev.SampleFailed(
                        sample_id=t.trajectory_id,
                        group_id=t.group_id,
                        index=t.index,
                        rank=t.rank,
                        error=got,
                        stage="reward",
                    )
                )
            else:
                out.append(
                    ev.SampleScored(sample_id=t.trajectory_id, group_id=t.group_id, reward=got, correct=got >= 1.0)
                )
        return out

    def _already_scored(self, p: ev.SampleFinished) -> bool:
        """Scored already, or not finished in the log (a late result of a rank that lost the sample's group). Under
        the lock."""
        state = self.follower.state
        if state.group_gone(p.trajectory.group_id) is not None:
            return True  # retired: every finished sample of it was scored (or it is a late result)
        g = state.groups.get(p.trajectory.group_id)
        smp = g.samples.get(p.trajectory.index) if g else None
        return smp is not None and (smp.reward is not None or smp.status != SampleStatus.FINISHED)


def answer_tokens(t: Trajectory) -> list[int]:
    """The tokens a sample is scored on: its completion, or for an episode (a task with an environment) the
    policy's last turn, its final answer (the environment's replies and the policy's earlier turns are context)."""
    if not t.turns:
        return list(t.token_ids)
    last = next((turn for turn in reversed(t.turns) if turn.source == "policy"), None)
    return [] if last is None else list(t.token_ids[last.start : last.end])
