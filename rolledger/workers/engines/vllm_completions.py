"""The `/v1/completions` wire format a vLLM rank speaks: the request body of a group, the health probe's request,
the parsing of one returned choice into a SampleOutput (token ids, logprobs, finish reason), and the accumulation of
a streamed choice's deltas into one (`StreamedChoice`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from rolledger.schemas.config import SamplingParams
from rolledger.workers.engines.protocol import EngineError, SampleOutput

PROBE_PROMPT: tuple[int, ...] = (1, 4, 5, 6, 7)  # a fixed token sequence; any ids inside a tiny vocab
_FINISH: dict[str, Literal["stop", "length", "abort"]] = {"stop": "stop", "length": "length", "abort": "abort"}


def completion_request(
    model_name: str, prompt_token_ids: Sequence[int], n: int, sampling: SamplingParams
) -> dict[str, Any]:
    """The /v1/completions body of a group of `n` samples of one prompt."""
    body: dict[str, Any] = {
        "model": model_name,
        "prompt": [int(t) for t in prompt_token_ids],
        "n": n,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    return body


def probe_request(model_name: str) -> dict[str, Any]:
    """The health probe's /v1/completions body: 4 greedy tokens of PROBE_PROMPT, EOS ignored."""
    return {
        "model": model_name,
        "prompt": list(PROBE_PROMPT),
        "max_tokens": 4,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
        "ignore_eos": True,
        "skip_special_tokens": False,
    }


def parse_choice(choice: Mapping[str, Any], rank: int) -> SampleOutput:
    """One returned choice as a SampleOutput; EngineError (naming `rank`) when it lacks or mismatches a field."""
    token_ids = choice.get("token_ids")
    lp = (choice.get("logprobs") or {}).get("token_logprobs")
    if token_ids is None or lp is None:
        raise EngineError(
            f"rank {rank}: vLLM completion lacks token_ids/logprobs (server too old for return_token_ids?)"
        )
    if len(lp) != len(token_ids):
        raise EngineError(f"rank {rank}: {len(token_ids)} tokens but {len(lp)} logprobs from vLLM")
    reason = choice.get("finish_reason")
    if reason not in _FINISH:
        raise EngineError(f"rank {rank}: unknown finish_reason {reason!r} from vLLM")
    return SampleOutput(
        token_ids=[int(t) for t in token_ids],
        logprobs=[float(x) if x is not None else -math.inf for x in lp],
        finish_reason=_FINISH[reason],
    )


class StreamedChoice:
    """One sample of a streamed completion: each event's delta of one choice (token ids, logprobs, maybe its finish
    reason) appended until it finishes, or until it holds `budget` tokens (a continuation request may ask for more
    than one of its samples may still take: the rest of that sample's stream is ignored)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish: Literal["stop", "length", "abort"] | None = None
        self._full = False  # ended here at its budget: later deltas of its stream are dropped

    def add(self, delta: Mapping[str, Any], rank: int) -> SampleOutput | None:
        """Append one streamed delta; the sample when this delta ends it, else None."""
        if self._full:
            return None
        if self.finish is not None:
            raise EngineError(f"rank {rank}: vLLM streamed more of a choice that had finished")
        token_ids = delta.get("token_ids")
        lp = (delta.get("logprobs") or {}).get("token_logprobs")
        if token_ids is None and lp is None and not delta.get("text"):
            token_ids, lp = [], []  # a delta that only carries the finish reason
        if token_ids is None or lp is None:
            raise EngineError(
                f"rank {rank}: vLLM streamed a delta without token_ids/logprobs (server too old for return_token_ids?)"
            )
        if len(lp) != len(token_ids):
            raise EngineError(f"rank {rank}: vLLM streamed {len(token_ids)} tokens but {len(lp)} logprobs")
        room = self.budget - len(self.token_ids)
        self.token_ids += [int(t) for t in token_ids[:room]]
        self.logprobs += [float(x) if x is not None else -math.inf for x in lp[:room]]
        reason = delta.get("finish_reason")
        if len(token_ids) >= room and (reason is None or len(token_ids) > room):
            self._full, reason = True, "length"  # its budget is spent (what follows, if anything, is not its)
        if reason is None:
            return None
        if reason not in _FINISH:
            raise EngineError(f"rank {rank}: unknown finish_reason {reason!r} from vLLM")
        self.finish = _FINISH[reason]
        return self.output()

    def reopen(self) -> None:
        """A sample cut short ("abort") that goes on in a continuation request."""
        self.finish = None

    def output(self) -> SampleOutput:
        """The sample as it stands: finished, or cut short ("abort") with the tokens it had."""
        return SampleOutput(
            token_ids=list(self.token_ids), logprobs=list(self.logprobs), finish_reason=self.finish or "abort"
        )
