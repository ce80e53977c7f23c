"""What an SGLang rank keeps between calls (`SglangRankState`): the versions the server can load (`Loaded`: live, the
previous one, the staged one), pause, the requests in flight, the sleep state, the counters. Shared by the engine
(sglang_engine.py) and its weight update (sglang_update.py), under the engine's condition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from rolledger.workers.engines.protocol import EngineStats
from rolledger.workers.engines.sleep_state import SleepState


@dataclass(frozen=True)
class Loaded:
    """A version the server can load: its directory, HF-named tensors, digest and expected live checksums."""

    version: int
    directory: Path
    tensors: dict[str, torch.Tensor]
    digest: str
    checksums: dict[str, tuple[str, tuple[str, ...]]]


@dataclass
class SglangRankState:
    live: Loaded
    previous: Loaded | None = None
    staged: Loaded | None = None
    cache_generation: int = 0
    paused: bool = False
    sleep: SleepState = field(default_factory=SleepState)  # per tag (workers/engines/sleep_state)
    inflight: int = 0
    stats: EngineStats = field(default_factory=EngineStats)
