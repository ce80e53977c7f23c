"""What a vLLM rank keeps between calls (`VllmRankState`): the version and digest it serves, pause, the requests in
flight, the sleep state, what is staged, the counters. Shared by the engine (vllm_engine.py), its generation
(vllm_generate.py) and its weight update (vllm_update.py), each under the engine's locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rolledger.workers.engines.protocol import EngineStats, PauseMode
from rolledger.workers.engines.sleep_state import SleepState
from rolledger.workers.engines.spec_counters import SpecCounters


@dataclass
class VllmRankState:
    policy_version: int = 0
    cache_generation: int = 0
    graph_generation: int = 0
    paused: bool = False
    pause_mode: PauseMode | None = None  # how the engine was paused (None while it generates)
    in_flight: int = 0  # completion requests counted before they were sent, whose answer has not come back yet
    sleep: SleepState = field(default_factory=SleepState)  # per tag (workers/engines/sleep_state)
    staged_version: int | None = None
    weights_digest: str = ""
    stats: EngineStats = field(default_factory=EngineStats)
    # where a speculative draft runs: the counters at the last reading, and the acceptance over the window before the
    # last commit (workers/engines/spec_counters.py)
    spec_mark: SpecCounters | None = None
    spec_before: float | None = None
