"""A real engine made slow: every group takes `delay_s` longer, spent after its samples started (the heartbeat tests).
Everything else is the wrapped engine's own; a wrapper like workers/operator/faults.py's FaultyEngine, kept with the tests
because a slow engine is not a fault the run's --inject vocabulary offers."""

from __future__ import annotations

import time
from typing import Any


class SlowEngine:
    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.delay_s)  # the slowness itself: a long group
        return self.inner.generate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
