"""The health probe's verdict on a speculative draft after an update: a draft that the new policy no longer matches
shows as its acceptance falling (the share of its proposed tokens the target model accepts), which costs throughput
but no correctness, and is seed 004's signal that a level-2 wake lost the draft. The probe fails when the acceptance on
the new weights is below (1 - max_drop) of what it was before the commit; where either window measured nothing (no
draft, or nothing drafted) there is nothing to judge.
"""

from __future__ import annotations


def acceptance_drop(before: float | None, after: float | None, max_drop: float) -> str:
    """Why the probe fails on the draft's acceptance ('' when it does not): `after` below (1 - max_drop) x
    `before`."""
    if before is None or after is None or before <= 0:
        return ""
    floor = (1.0 - max_drop) * before
    if after < floor:
        return (
            f"speculative acceptance fell from {before:.2f} to {after:.2f} on the new weights (below {floor:.2f}: "
            f"update.max_spec_acceptance_drop = {max_drop:g}); the draft does not match the new policy"
        )
    return ""
