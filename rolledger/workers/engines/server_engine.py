"""What the engines over an inference server's HTTP routes (workers.engines.vllm_engine, workers.engines.sglang_engine)
share: the health probe's verdict on the sample the server generated (finite logprobs, and a digest of what it
answered), and the refusal of a level-2 sleep where the server must not discard its weights.
"""

from __future__ import annotations

import json
import math

import xxhash

from rolledger.workers.engines.protocol import EngineError, HealthReport, SampleOutput


def probe_report(rank: int, sample: SampleOutput) -> HealthReport:
    """The health of a rank whose server answered the greedy probe with `sample`: not ok when a logprob is not
    finite, else ok with the digest of its tokens and logprobs (rounded to 3 places)."""
    if not all(math.isfinite(x) for x in sample.logprobs):
        return HealthReport(ok=False, detail=f"rank {rank}: probe logprobs not finite: {sample.logprobs}")
    h = xxhash.xxh3_128()
    h.update(json.dumps([sample.token_ids, [round(x, 3) for x in sample.logprobs]]).encode())
    return HealthReport(ok=True, detail=f"rank {rank}: probe ok", probe_digest=h.hexdigest())


def refuse_level_2(rank: int, level: int, refused: str) -> None:
    """EngineError for `sleep(2)` on a server that must not sleep at level 2 (`refused`: why, '' when it may)."""
    if level == 2 and refused:
        raise EngineError(f"rank {rank}: sleep(2) refused: {refused}; sleep at level 1")
