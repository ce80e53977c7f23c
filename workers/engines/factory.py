"""Build the engines of a run, one per rank, from the run config and the saved policy directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from schemas.config import RunConfig
from workers.engine import Engine


def build_engines(cfg: RunConfig, model_dir: Path, tokenizer: Any, run_dir: Path) -> tuple[list[Engine], Callable[[], None]]:
    """The engines for `cfg.ranks` ranks and a function that releases them (servers started here are stopped)."""
    if cfg.engine == "torch":
        from workers.engines.torch_engine import TorchEngine
        from workers.policy_model import load_policy

        engines: list[Engine] = []
        for r in range(cfg.ranks):
            model, _ = load_policy(model_dir)
            engines.append(TorchEngine(model, tokenizer, rank=r))

        def close() -> None:
            for e in engines:
                e.close()

        return engines, close
    raise NotImplementedError(f"engine {cfg.engine!r} is not wired into `rolledger run` yet")
