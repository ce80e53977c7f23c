"""The sleep state of one engine, per tag, and the rules of the colocated order: one pure state machine that every
engine (torch, simulated, vLLM, SGLang) keeps and consults, so the rules live here once.

The legal colocated cycle, as vLLM documents it for an RL step (docs/features/sleep_mode.md) and SGLang's
release/resume_memory_occupation tags allow:

    sleep(level) -> wake(weights) -> prepare -> commit -> wake(kv_cache) -> health -> generate

- `sleep(level)` (1 or 2) puts both tags to sleep; refused while any tag still sleeps.
- `wake(tags)` wakes the requested tags that sleep (a tag already awake is left alone: vLLM's executor wakes nothing
  at all when asked for a tag that does not sleep, so an engine sends only `woken`); kv_cache may not wake before
  weights. The level stays until every tag is awake.
- prepare, stage and commit (and rollback) need the weights awake; the KV cache may still sleep ("weights awake, KV
  asleep" is the state an update is made in: never send weights while they sleep, vLLM #57853).
- generate, the health probe and the served digest need both tags awake, and after a level-2 sleep also new weights
  committed (level 2 discards the weights: a weights wake reallocates them uninitialised).

Every refusal is IllegalEngineOrder naming the order it broke. `SleepState` is immutable: a transition returns the
next state (or raises), so an engine that talks to a server computes it, makes the call, and keeps it on success.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from rolledger.workers.engines.protocol import IllegalEngineOrder, WakeTag

TAGS: tuple[WakeTag, ...] = ("weights", "kv_cache")  # the wake order
LEVELS = (1, 2)
ORDER = "sleep(level) -> wake(weights) -> prepare -> commit -> wake(kv_cache) -> health -> generate"


@dataclass(frozen=True)
class SleepState:
    """Which tags sleep, at what level, and whether the live weights may serve (False after a level-2 weights wake,
    until a commit)."""

    level: int = 0
    asleep: frozenset[WakeTag] = frozenset()
    weights_valid: bool = True

    # -- queries ------------------------------------------------------------------------------------------------

    @property
    def asleep_level(self) -> int:
        """The Engine protocol's `asleep_level`: the level while any tag sleeps, 0 once every tag is awake."""
        return self.level if self.asleep else 0

    @property
    def weights_awake(self) -> bool:
        return "weights" not in self.asleep

    @property
    def kv_awake(self) -> bool:
        return "kv_cache" not in self.asleep

    @property
    def serving(self) -> bool:
        """Both tags awake and the weights valid: generate, health and the served digest may run."""
        return not self.asleep and self.weights_valid

    def describe(self) -> str:
        if not self.asleep:
            return "awake" if self.weights_valid else "awake, weights not committed since a level-2 sleep"
        return f"level {self.level}, asleep: {', '.join(t for t in TAGS if t in self.asleep)}"

    # -- checks -------------------------------------------------------------------------------------------------

    def check_weights_awake(self, what: str, rank: int) -> None:
        """prepare / stage / commit / rollback: IllegalEngineOrder while the weights sleep."""
        if not self.weights_awake:
            raise IllegalEngineOrder(
                f"rank {rank}: never update weights while asleep ({what} refused; {self.describe()}): "
                f"wake(['weights']) first (order: {ORDER})"
            )

    def check_serving(self, what: str, rank: int) -> None:
        """generate / weights_digest: IllegalEngineOrder unless both tags are awake and the weights valid."""
        if self.asleep:
            wake = "wake(['weights']), then wake(['kv_cache'])" if not self.weights_awake else "wake(['kv_cache'])"
            raise IllegalEngineOrder(
                f"rank {rank}: {what} refused while asleep ({self.describe()}); {wake} first (order: {ORDER})"
            )
        if not self.weights_valid:
            raise IllegalEngineOrder(
                f"rank {rank}: {what} refused before new weights were committed after a level-2 sleep (order: {ORDER})"
            )

    # -- transitions --------------------------------------------------------------------------------------------

    def slept(self, level: int, rank: int) -> SleepState:
        """The state after sleep(level). ValueError for a level other than 1 or 2."""
        if level not in LEVELS:
            raise ValueError(f"sleep level must be 1 or 2 (got {level})")
        if self.asleep:
            raise IllegalEngineOrder(
                f"rank {rank}: sleep({level}) refused: already asleep ({self.describe()}); wake every tag first"
            )
        return SleepState(level=level, asleep=frozenset(TAGS), weights_valid=self.weights_valid)

    def woken(self, tags: Sequence[str], rank: int) -> tuple[SleepState, tuple[WakeTag, ...]]:
        """The state after wake(tags), and the tags that actually wake (requested and asleep, in wake order).
        ValueError for an empty or unknown tag list; IllegalEngineOrder for kv_cache before weights."""
        requested = set(tags)
        if not requested or requested - set(TAGS):
            raise ValueError(f"wake tags must be a non-empty subset of {list(TAGS)} (got {list(tags)})")
        if "kv_cache" in requested and not self.weights_awake and "weights" not in requested:
            raise IllegalEngineOrder(
                f"rank {rank}: wake kv_cache before weights refused: wake(['weights']) first (order: {ORDER})"
            )
        woken = tuple(t for t in TAGS if t in requested and t in self.asleep)
        asleep = self.asleep - set(woken)
        valid = self.weights_valid and not ("weights" in woken and self.level == 2)
        return SleepState(level=self.level if asleep else 0, asleep=frozenset(asleep), weights_valid=valid), woken

    def committed(self) -> SleepState:
        """New weights are live (a commit or rollback, which check_weights_awake allowed)."""
        return replace(self, weights_valid=True)


def level_2_refusal(*, speculative: str, kv_cache_dtype: str) -> str:
    """Why a server so configured must not sleep at level 2 ('' when it may), seed 004's pitfalls:

    - a speculative draft: a level-2 sleep discards it with the target's weights, and neither a level-2 wake nor the
      target's reload brings it back (vLLM #52479: acceptance drops to 0, a silent ~2x slowdown);
    - an FP8 KV cache: a level-2 sleep loses its calibrated k/v scales (vLLM #25800, #48310, #57163: scales read
      back as 1.0 or 0.0, logprobs shift with identical weights).

    Level 1 keeps both (the weights and buffers are backed up to host memory), so these servers sleep at level 1."""
    if speculative:
        return (
            f"a speculative draft is configured ({speculative}) and a level-2 wake does not reload it "
            "(vLLM #52479: acceptance drops to 0)"
        )
    if kv_cache_dtype.lower().startswith("fp8"):
        return (
            f"the KV cache is FP8 ({kv_cache_dtype}) and a level-2 sleep loses its calibrated scales "
            "(vLLM #25800, #48310: logprobs shift)"
        )
    return ""
