"""The environment plug-in's interface: what a task's environment is given each turn and what it answers (issue 40).

A task may declare an environment by import path (`task.env = "module:function"`, as reward functions are given).
Every sample is then an episode: the policy generates a turn, the rank calls `step(history: EnvHistory) ->
EnvReply`, appends the reply's tokens (loss mask 0, logprob 0: never trained on), and the policy continues from the
whole context, until the reply says `done`, the policy has had `task.max_turns` turns, or the episode's completion
reached `task.max_episode_tokens`. The rank runs each step in a process of its own with `task.env_timeout_s`
(workers/policy/envs.py): a step that raises, hangs or answers something that is not an EnvReply fails its sample
only (SampleFailed, stage "env"), in one line naming the environment and the turn.

A step is a function of its history: the prompt, every turn so far with its tokens and text (the policy's decoded
by the rank's tokenizer; '' where the rank has none, and then a reply must give token ids), and the `info` each of
the environment's earlier replies carried (what a stateful environment keeps between its steps). Its reply is text
(tokenized by the rank, no special tokens added) or token ids, `done`, and `info`. Both are pydantic models, as the
client API's and the reward functions' inputs are: a reply given as a dict is validated like one.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, model_validator

from rolledger.schemas.base import Model

TokenId = Annotated[int, Field(ge=0)]


class EnvTurn(Model):
    """One turn so far: its source, its tokens, and their text."""

    source: Literal["policy", "env"]
    token_ids: tuple[TokenId, ...]
    text: str = ""
    info: dict[str, Any] = Field(default_factory=dict)  # env turns: the `info` of the reply that made it


class EnvHistory(Model):
    """What `step` is given: the sample, its prompt and ground truth, and its turns so far (the last one the
    policy's: the turn the environment answers)."""

    sample_id: str
    prompt_id: str
    prompt: str  # the prompt's text, decoded from its token ids ('' where the rank has no tokenizer)
    prompt_token_ids: tuple[TokenId, ...]
    answer: str  # the group's ground truth, as the reward functions get it
    turns: tuple[EnvTurn, ...]

    @property
    def policy_turns(self) -> int:
        return sum(1 for t in self.turns if t.source == "policy")

    @property
    def last(self) -> EnvTurn:
        """The policy's turn this step answers."""
        return self.turns[-1]


class EnvReply(Model):
    """The environment's answer to a turn: text or token ids to append (neither: nothing), whether the episode is
    done, and what it keeps for its next step (`info`, given back in the history)."""

    text: str | None = None
    token_ids: tuple[TokenId, ...] | None = None
    done: StrictBool = False
    info: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_form(self) -> EnvReply:
        if self.text is not None and self.token_ids is not None:
            raise ValueError("give the reply as text or as token_ids, not both")
        return self
