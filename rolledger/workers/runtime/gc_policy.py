"""How a process that serves a run uses Python's cyclic garbage collector: `serving()` around the run's roles.

Why. CPython's collector runs a young collection every 700 net allocations and a full one every 100 of those, and a
full collection walks every tracked object in the process: the imported modules (torch and transformers bring ~380k),
the model, every role's folded state, the tail's buffer. The control plane allocates several objects per event
(decoded models, envelopes, dicts), so at bench_scale's rate (512x16, 16 ranks in one process) the collector took
5.6 s of a 23 s run's CPU, 4.6 s of it in 23 full collections. The roles' data is acyclic by construction (frozen
models, dataclasses, dicts of them): reference counting frees it, and the collector finds next to nothing.

What `serving()` does, and undoes on exit:

- everything alive when it is entered (modules, model, tokenizer, the roles as built) moves to the permanent
  generation (`gc.freeze`, after one full collection), so later full collections do not walk it;
- the young generation is collected every `YOUNG_THRESHOLD` net allocations instead of 700 (the older generations
  keep their ratios of 10), so the rare cycle is still collected, in milliseconds, within seconds.

On exit the frozen objects rejoin the oldest generation and the thresholds are restored: a process that runs several
runs in turn (the test suite) leaks nothing frozen. Measured by `python bench/bench_scale.py`, with and without.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 20_000
OLDER_RATIO = 10


@contextmanager
def serving() -> Iterator[None]:
    """See the module docstring. Not nested: the outermost one decides (an inner one is a no-op)."""
    if gc.get_freeze_count():  # an enclosing serving() is in force
        yield
        return
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, OLDER_RATIO, OLDER_RATIO)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
