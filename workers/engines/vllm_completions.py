"""The `/v1/completions` wire format a vLLM rank speaks: the request body of a group, the health probe's request,
and the parsing of one returned choice into a SampleOutput (token ids, logprobs, finish reason).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from rolledger.schemas.config import SamplingParams
from rolledger.workers.engine import EngineError, SampleOutput

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
