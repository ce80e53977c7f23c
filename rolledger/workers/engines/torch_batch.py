"""Continuous batching across groups for the torch engine: one decode step runs the samples of every group in flight.

A rank with several rollout slots calls `TorchEngine.generate` from several threads at once. Without this module
each call decodes its own group under the model lock, one group at a time. With it (`TorchEngine(batch_groups=True)`,
which the factory sets when `rank_slots > 1`), each call becomes a `BatchRequest` handed to one decode thread per
engine (`GroupBatcher`), and that thread keeps a single decode batch:

- a group joins between two steps: its prompt is prefilled (through the prefix cache) and its n rows are appended to
  the batch's KV cache, left-padded to a common length; an attention mask hides the padding and each row carries its
  own position ids, so a row computes what it would compute alone;
- every step samples each group's rows with that group's own sampling parameters and seeded generator, then runs one
  forward for all rows;
- a sample that ends (stop, length, or cancelled: a first k reached, its group closed) leaves the batch at once, and
  the columns no remaining row uses are cut off, so finished and cancelled rows cost nothing afterwards.

The decode thread calls `should_cancel` (a cheap read: it must not block) between steps; `on_sample` runs in the
calling thread, which receives each ended sample through its request's outbox, so a callback that raises (its claim
was lost) affects only its own group: that group's rows are cancelled and the call raises once they have left.
Pause, park and abort are the engine's (`poll`), checked once per step for the whole batch, as the unbatched path
checks them once per step for its group.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from transformers import DynamicCache

from rolledger.schemas.config import SamplingParams
from rolledger.workers.engines.protocol import EngineError, GroupOutput, SampleOutput
from rolledger.workers.engines.torch_decode import Decoded, FinishReason, KVDecoder, sample

Ended = tuple[Literal["ended"], int, SampleOutput]
Done = tuple[Literal["done"], GroupOutput | BaseException]


@dataclass(eq=False)
class BatchRequest:
    """One generate call: a group of n samples of one prompt, its callbacks and its results so far."""

    prompt: list[int]
    n: int
    sampling: SamplingParams
    should_cancel: Callable[[int], bool] | None
    streams: bool  # hand each ended sample to the caller as it ends
    cancelled: bool = False  # set by the caller when its on_sample raised: every row of the group ends "abort"
    outbox: queue.SimpleQueue[Ended | Done] = field(default_factory=queue.SimpleQueue)
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish: list[FinishReason | None] = field(default_factory=list)
    spans: list[list[tuple[int, int, str]]] = field(default_factory=list)
    gen: torch.Generator | None = None
    computed: int = 0
    saved: int = 0
    version: int = 0
    taken_on: tuple[int, str] | None = None  # the (version, digest) serving when the engine took the request

    def start(self, version: int, digest: str, device: torch.device) -> None:
        """Join the batch on `version`. A request taken before a commit that waited for the batch meanwhile (an
        interruptible engine parks it with the batch) starts with an empty span of the version it was taken on, so
        each sample says that version first and the new one for all its tokens."""
        self.version = version
        self.tokens = [[] for _ in range(self.n)]
        self.logprobs = [[] for _ in range(self.n)]
        self.finish = [None] * self.n
        first = [(0, *self.taken_on)] if self.taken_on is not None and self.taken_on != (version, digest) else []
        self.spans = [[*first, (0, version, digest)] for _ in range(self.n)]
        self.gen = torch.Generator(device=device)
        if self.sampling.seed is not None:
            self.gen.manual_seed(self.sampling.seed)
        else:
            self.gen.seed()

    def output(self, i: int) -> SampleOutput:
        spans = tuple(self.spans[i]) if len(self.spans[i]) > 1 else ()
        return SampleOutput(
            token_ids=list(self.tokens[i]),
            logprobs=list(self.logprobs[i]),
            finish_reason=self.finish[i] or "length",
            spans=spans,
        )

    def end(self, stamp: Callable[[Decoded], GroupOutput]) -> None:
        """Every sample has ended: hand the caller the whole group, stamped (`stamp`: the engine's weights digest and
        cache and graph generations) while the decode thread still holds the model lock, so no commit between the
        group's last step and the caller's return can stamp it."""
        samples = [self.output(i) for i in range(self.n)]
        self.outbox.put(("done", stamp(Decoded(samples, self.version, self.computed, self.saved))))

    def fail(self, exc: BaseException) -> None:
        self.outbox.put(("done", exc))

    def abort_unfinished(self) -> None:
        self.finish = [f if f is not None else "abort" for f in self.finish]


@dataclass
class BatchCounters:
    """What the batch did: steps run, groups summed over steps, the most groups one step held, and the wall time
    its steps took (sampling and forward, not prefills or parks)."""

    steps: int = 0
    group_steps: int = 0
    max_groups: int = 0
    step_s: float = 0.0


class DecodeBatch:
    """The rows being decoded together: their KV cache (left-padded), attention mask, next positions and logits.

    The cache object is kept from step to step (the forward appends to it); it is rebuilt only when a group joins,
    and sliced in place when rows leave."""

    def __init__(self, decoder: KVDecoder, config: Any) -> None:
        self._decoder = decoder
        self._config = config
        self.rows: list[tuple[BatchRequest, int]] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [rows, columns]: 1 where a row has a token
        self._pos: torch.Tensor | None = None  # [rows]: the position of each row's next token
        self.logits: torch.Tensor | None = None  # [rows, vocab]: each row's next-token logits

    def join(self, req: BatchRequest, cache: DynamicCache, logits: torch.Tensor) -> None:
        """Append the n rows of a freshly prefilled group (cache of its prompt at batch n, logits [n, vocab])."""
        length = len(req.prompt)
        device = logits.device
        mine = torch.ones(req.n, length, dtype=torch.long, device=device)
        at = torch.full((req.n,), length, dtype=torch.long, device=device)
        if self._cache is None or self._mask is None or self._pos is None or self.logits is None:
            self._cache, self._mask, self._pos, self.logits = cache, mine, at, logits
        else:
            width = max(self._mask.shape[1], length)
            kv = [
                (
                    torch.cat([_left_pad(old.keys, width), _left_pad(new.keys, width)]),
                    torch.cat([_left_pad(old.values, width), _left_pad(new.values, width)]),
                )
                for old, new in zip(_layers(self._cache), _layers(cache), strict=True)
            ]
            self._cache = DynamicCache(ddp_cache_data=kv, config=self._config)
            self._mask = torch.cat([_left_pad(self._mask, width, dim=1), _left_pad(mine, width, dim=1)])
            self._pos = torch.cat([self._pos, at])
            self.logits = torch.cat([self.logits, logits])
        self.rows.extend((req, i) for i in range(req.n))

    def keep(self, keep: list[int]) -> None:
        """Only these rows stay; columns no remaining row uses are cut off the left."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[r] for r in keep]
        if not self.rows or self._cache is None or self._mask is None or self._pos is None:
            self._cache, self._mask, self._pos, self.logits = None, None, None, None
            return
        idx = torch.tensor(keep, device=self._mask.device)
        mask = self._mask[idx]
        first = int(mask.any(dim=0).int().argmax())  # the first column a remaining row uses
        self._mask = mask[:, first:]
        self._pos = self._pos[idx]
        for layer in _layers(self._cache):
            layer.keys = layer.keys[idx, :, first:]
            layer.values = layer.values[idx, :, first:]

    def forward(self, next_ids: torch.Tensor) -> None:
        """Feed each row's sampled token: one forward for the whole batch; new logits for every row."""
        assert self._cache is not None and self._mask is not None and self._pos is not None
        mask = torch.cat([self._mask, torch.ones(len(self.rows), 1, dtype=torch.long, device=self._mask.device)], 1)
        out = self._decoder.forward_step(next_ids[:, None], self._cache, mask, self._pos[:, None])
        self._cache = self._decoder.out_cache(out)
        self._mask = mask
        self._pos = self._pos + 1
        self.logits = out.logits[:, -1, :].float()


def _layers(cache: DynamicCache) -> list[Any]:
    """The cache's per-layer holders of `keys` and `values` [rows, heads, columns, head_dim]."""
    return list(cast(Any, cache).layers)


def _left_pad(t: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """`t` with zeros prepended along `dim` up to `width` (masked out: no row attends to them)."""
    short = width - t.shape[dim]
    if short == 0:
        return t
    shape = list(t.shape)
    shape[dim] = short
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class GroupBatcher:
    """The decode loop over a `DecodeBatch`; run by the engine's decode thread while it holds the model lock.

    `take()` returns the requests submitted since the last call and `pending()` counts them without taking them;
    `poll(version, held)` is the engine's pause check (False: end every unfinished sample "abort"; `held()` counts the
    requests a park holds, including those submitted while it is parked); `serving()` is the (version, digest)
    serving now; `stamp(decoded)` makes an ended group the engine's output (called with the model lock held).
    `max_groups`: the most groups one step decodes (None: every request taken); the others wait, in order, and join
    at the first step with room, so a caller that keeps a request more in flight than that has the next group join
    the step after one ends instead of after its own round trip (a waiting request whose samples are all cancelled
    ends at once, never batched).
    """

    def __init__(
        self,
        decoder: KVDecoder,
        config: Any,
        *,
        eos_id: int,
        device: torch.device,
        take: Callable[[], list[BatchRequest]],
        pending: Callable[[], int],
        poll: Callable[[int, Callable[[], int]], bool],
        serving: Callable[[], tuple[int, str]],
        stamp: Callable[[Decoded], GroupOutput],
        max_groups: int | None = None,
    ) -> None:
        if max_groups is not None and max_groups < 1:
            raise ValueError(f"max_groups must be >= 1 (got {max_groups})")
        self._max_groups = max_groups
        self._decoder = decoder
        self._config = config
        self._eos_id = eos_id
        self._device = device
        self._take = take
        self._pending = pending
        self._poll = poll
        self._serving = serving
        self._stamp = stamp
        self.counters = BatchCounters()

    @torch.inference_mode()
    def run(self) -> None:
        """Decode until no request is left, taking new ones between steps."""
        batch = DecodeBatch(self._decoder, self._config)
        waiting: list[BatchRequest] = []
        version, digest = self._serving()
        while True:
            waiting += self._take()
            requests = _unique(req for req, _ in batch.rows)
            if not batch.rows and not waiting:
                return
            try:

                def holding(base: int = len(requests) + len(waiting)) -> int:  # a park holds these and newer ones
                    return base + self._pending()

                if not self._poll(version, holding):
                    for req in [*requests, *waiting]:
                        if not req.finish:
                            req.start(version, digest, self._device)
                        req.abort_unfinished()
                        req.end(self._stamp)
                    batch.keep([])
                    waiting = []
                    continue
                now, digest = self._serving()
                if now != version:  # interruptible: new weights were committed while parked
                    version = now
                    for req in requests:
                        req.version = version
                    for req, i in batch.rows:
                        req.spans[i].append((len(req.tokens[i]), version, digest))
                room = len(waiting) if self._max_groups is None else max(0, self._max_groups - len(requests))
                for req in waiting[:room]:
                    req.start(version, digest, self._device)
                    cache, logits, req.computed, req.saved = self._decoder.prefill(req.prompt, req.n)
                    batch.join(req, cache, logits)
                waiting = waiting[room:]
                for req in [r for r in waiting if all(_cancelled(r, i) for i in range(r.n))]:
                    # every sample cut while it waited for room: it ends before its first token, never batched
                    req.start(version, digest, self._device)
                    req.abort_unfinished()
                    req.end(self._stamp)
                    waiting.remove(req)
                started = time.perf_counter()
                self._step(batch)
                self.counters.step_s += time.perf_counter() - started
            except Exception as exc:  # noqa: BLE001 - a failed forward fails every group in it, not the thread
                for req in [*_unique(req for req, _ in batch.rows), *waiting]:
                    req.fail(exc)
                batch.keep([])
                waiting = []

    def _step(self, batch: DecodeBatch) -> None:
        """Cancel, sample, hand over the ended samples, drop their rows, and run one forward."""
        for req, i in batch.rows:
            if req.finish[i] is None and _cancelled(req, i):
                req.finish[i] = "abort"
        assert batch.logits is not None
        order = _unique(req for req, _ in batch.rows)
        c = self.counters
        c.steps += 1
        c.group_steps += len(order)
        c.max_groups = max(c.max_groups, len(order))
        next_ids = torch.zeros(len(batch.rows), dtype=torch.long, device=batch.logits.device)
        for req in order:
            rows = [r for r, (q, _) in enumerate(batch.rows) if q is req]
            live = [r for r in rows if req.finish[batch.rows[r][1]] is None]
            if not live:
                continue
            idx = torch.tensor(live, device=batch.logits.device)
            ids, raw_lp, proc_lp = sample(batch.logits[idx], req.sampling, cast(torch.Generator, req.gen))
            chosen = raw_lp if req.sampling.logprob_mode == "raw" else proc_lp
            next_ids[idx] = ids
            stops = set(req.sampling.stop_token_ids) | {self._eos_id}
            for r, tok, lp in zip(live, ids.tolist(), chosen.tolist(), strict=True):  # one copy out, not one per row
                i = batch.rows[r][1]
                req.tokens[i].append(tok)
                req.logprobs[i].append(lp)
                if tok in stops:
                    req.finish[i] = "stop"
                elif len(req.tokens[i]) >= req.sampling.max_tokens:
                    req.finish[i] = "length"
                if req.finish[i] is not None and req.streams:
                    req.outbox.put(("ended", i, req.output(i)))
        for req in order:
            if all(f is not None for f in req.finish):
                req.end(self._stamp)
        keep = [r for r, (q, i) in enumerate(batch.rows) if q.finish[i] is None]
        ids_kept = next_ids[torch.tensor(keep, dtype=torch.long, device=next_ids.device)] if keep else next_ids[:0]
        batch.keep(keep)
        if batch.rows:
            batch.forward(ids_kept)


def _cancelled(req: BatchRequest, i: int) -> bool:
    if req.cancelled:
        return True
    if req.should_cancel is None:
        return False
    try:
        return req.should_cancel(i)
    except Exception:  # noqa: BLE001 - a failing check ends its own group's samples, never the batch
        return True


def _unique(reqs: Any) -> list[BatchRequest]:
    seen: dict[int, BatchRequest] = {}
    for r in reqs:
        seen.setdefault(id(r), r)
    return list(seen.values())


def wait_for(
    req: BatchRequest, on_sample: Callable[[int, SampleOutput], None] | None, alive: Callable[[], bool]
) -> GroupOutput:
    """In the calling thread: run `on_sample` for each sample as it ends, then return the group (or raise).

    If `on_sample` raises, the group's remaining rows are cancelled and the exception is raised once they have left
    the batch. `alive()` is the decode thread's liveness: a dead decode thread is an EngineError, not a hang.
    """
    failure: BaseException | None = None
    while True:
        try:
            msg = req.outbox.get(timeout=1.0)
        except queue.Empty:
            if not alive():
                raise EngineError("the torch engine's decode thread is gone") from failure
            continue
        if msg[0] == "ended":
            if on_sample is not None and failure is None:
                try:
                    on_sample(msg[1], msg[2])
                except BaseException as exc:  # noqa: BLE001 - re-raised below, after the group has left the batch
                    failure = exc
                    req.cancelled = True
            continue
        result = msg[1]
        if failure is not None:
            raise failure
        if isinstance(result, BaseException):
            raise result
        return result
