"""Benchmark of rollout through rolledger (run by hand): a RankWorker on a real redis-server vs the engine called directly.

    python bench/bench_rollout.py [--groups 32] [--n 8] [--max-tokens 16] [--fewshot 6] [--threads 1] [--slots 1]
                                  [--no-aof]

Workload (as bench/bench_engine.py): `--groups` prompts "<few-shot prefix> a+b=" on the tiny policy
(workers.policy_model, default ModelConfig with positions widened to fit), `--n` samples per group, `--max-tokens`,
temperature 1, seed = group index, so both paths sample exactly the same tokens (checked: the totals must match).

Measured side by side in one process, each on a fresh TorchEngine over the same weights, warmed up the same way:

  direct          engine.generate(prompt, n, sampling) for every group, from `--slots` threads at once (each takes
                  the next group when it is done with one; 1: a plain loop): the baseline;
  rolledger       a RankWorker (workers/rank.py) with `rank_slots = --slots` (the same concurrency) on its own
                  redis-server (AOF, appendfsync no as rolledger runs it, unless --no-aof), after it has
                  joined the run: the clock starts before G GroupAdmitted events are appended (one MULTI/EXEC) and
                  stops when the log holds a SampleFinished for every sample (counted on the entries' `t` field, so
                  the watcher decodes nothing). It includes everything the worker does per group: consumer-group read,
                  following the log, SampleStarted x n, generation, SampleFinished x n (encode + append), ack;
  direct, no cache  TorchEngine(prefix_cache=False), for the prefill comparison.

Printed: generated tokens/s of each, rolledger/direct as the overhead ratio (1.00 = free), and the prompt tokens
prefilled per group with the prefix cache vs without. The machine is shared: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import make_prompts
from bench_replay import redis_server

from rolledger.events.connection import connect
from rolledger.events.envelope import make_event
from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
from rolledger.schemas.config import ModelConfig, RunConfig, SamplingParams
from rolledger.workers.engines.torch_engine import TorchEngine
from rolledger.workers.policy_model import build_model, build_tokenizer, policy_state
from rolledger.workers.rank import RankWorker
from rolledger.workers.weights import state_digest

RUN_ID = "bench-rollout"


@dataclass
class Result:
    name: str
    seconds: float
    tokens: int
    prefill_computed: int
    groups: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def prefill_per_group(self) -> float:
        return self.prefill_computed / self.groups


def sampling_for(group: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=group)


def direct(name: str, engine: TorchEngine, prompts: list[list[int]], n: int, max_tokens: int, slots: int = 1) -> Result:
    """Every group through engine.generate, from `slots` threads at once (what a rank's rollout slots do)."""
    before = engine.stats.prefill_tokens_computed

    def one(g: int) -> int:
        out = engine.generate(prompts[g], n, sampling_for(g, max_tokens))
        return sum(len(s.token_ids) for s in out.samples)

    start = time.perf_counter()
    if slots == 1:
        tokens = sum(map(one, range(len(prompts))))
    else:
        with ThreadPoolExecutor(max_workers=slots) as pool:
            tokens = sum(pool.map(one, range(len(prompts))))
    seconds = time.perf_counter() - start
    return Result(name, seconds, tokens, engine.stats.prefill_tokens_computed - before, len(prompts))


XReadReply = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] | None


def wait_for_type(client: redis.Redis, key: str, type_: bytes, count: int, deadline_s: float) -> None:
    """Block until the stream holds `count` entries whose `t` field is `type_` (nothing decoded), or fail."""
    seen = 0
    after: str | bytes = "0-0"
    deadline = time.monotonic() + deadline_s
    while seen < count:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms < 1:
            raise SystemExit(f"timed out: {seen} of {count} {type_.decode()} after {deadline_s:.0f} s")
        # a sync client without decode_responses: [(stream, [(entry_id, fields)])] (redis-py types it Any | Awaitable)
        reply = cast(XReadReply, client.xread({key: after}, count=1000, block=remaining_ms))
        for _, entries in reply or []:
            for entry_id, fields in entries:
                after = entry_id
                seen += fields.get(b"t") == type_


def through_rolledger(
    url: str, engine: TorchEngine, model: torch.nn.Module, cfg: RunConfig, prompts: list[list[int]], deadline_s: float
) -> Result:
    client = connect(url)
    log = EventLog(client, RUN_ID)
    n, max_tokens = cfg.group_size, cfg.sampling.max_tokens
    log.append(
        make_event(
            ev.RunStarted(config=cfg, initial_weights_digest=state_digest(policy_state(model))),
            run_id=RUN_ID,
            producer="bench",
            policy_version=0,
        )
    )
    worker = RankWorker(client, RUN_ID, 0, engine)
    worker.start()
    try:
        wait_for_type(client, log.key, b"RankJoined", 1, deadline_s)
        admitted = [
            make_event(
                ev.GroupAdmitted(
                    group_id=f"g{g:06d}",
                    prompt_id=f"p{g}",
                    prompt_token_ids=ids,
                    n=n,
                    sampling=sampling_for(g, max_tokens),
                    partial_policy=cfg.partial_policy,
                    answer="0",
                    est_remaining_tokens=n * max_tokens,
                    est_bytes=1000 * n,
                    queued_bytes=0,
                    byte_cap=10**12,
                ),
                run_id=RUN_ID,
                producer="bench",
                policy_version=0,
            )
            for g, ids in enumerate(prompts)
        ]
        before = engine.stats.prefill_tokens_computed
        start = time.perf_counter()
        log.append_many(admitted)
        wait_for_type(client, log.key, b"SampleFinished", len(prompts) * n, deadline_s)
        seconds = time.perf_counter() - start
    finally:
        worker.stop()
        worker.join(timeout=30)
    if worker.error is not None:
        raise SystemExit(f"rank worker failed: {worker.error!r}")
    tokens = 0
    for stored in log.read(types={"SampleFinished"}):
        assert isinstance(stored.event.payload, ev.SampleFinished)
        tokens += len(stored.event.payload.trajectory.token_ids)
    return Result("rolledger", seconds, tokens, engine.stats.prefill_tokens_computed - before, len(prompts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--fewshot", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--slots", type=int, default=1, help="groups generated at once: rank_slots, and direct's threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-aof", action="store_true", help="redis without persistence (default: AOF, appendfsync no)")
    ap.add_argument("--deadline-s", type=float, default=600.0, help="give up waiting for the worker after this")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tok = build_tokenizer()
    prompts = [list(tok(t)["input_ids"]) for t in make_prompts(args.groups, args.fewshot, args.seed)]
    warm = [list(tok(t)["input_ids"]) for t in make_prompts(2, args.fewshot, args.seed + 1)]
    model_cfg = ModelConfig(max_position_embeddings=max(64, max(map(len, prompts + warm)) + args.max_tokens))
    cfg = RunConfig(
        group_size=args.n, rank_slots=args.slots, model=model_cfg, sampling=SamplingParams(max_tokens=args.max_tokens)
    )

    def engine(prefix_cache: bool = True) -> tuple[TorchEngine, torch.nn.Module]:
        model = build_model(model_cfg, len(tok), args.seed)
        e = TorchEngine(model, tok, prefix_cache=prefix_cache)
        direct("warmup", e, warm, args.n, args.max_tokens)  # same warm-up for every engine: same cache state after
        return e, model

    load_before = os.getloadavg()
    base = direct("direct", engine()[0], prompts, args.n, args.max_tokens, args.slots)
    nocache = direct("direct, no cache", engine(prefix_cache=False)[0], prompts, args.n, args.max_tokens, args.slots)
    with redis_server(aof=not args.no_aof) as (url, _):
        e, model = engine()
        ours = through_rolledger(url, e, model, cfg, prompts, args.deadline_s)
    load_after = os.getloadavg()

    print(
        f"\ngroups={args.groups} n={args.n} prompt tokens~{sum(map(len, prompts)) / len(prompts):.1f} "
        f"max_tokens={args.max_tokens} slots={args.slots} torch threads={args.threads} "
        f"redis aof={'off' if args.no_aof else 'appendfsync no'}"
    )
    print(f"{'path':<18} {'seconds':>8} {'gen tokens':>11} {'tok/s':>8} {'vs direct':>10} {'prefill/group':>14}")
    for r in (base, ours, nocache):
        print(
            f"{r.name:<18} {r.seconds:>8.2f} {r.tokens:>11} {r.tok_s:>8.0f} {r.tok_s / base.tok_s:>9.2f}x "
            f"{r.prefill_per_group:>14.1f}"
        )
    same = "same tokens" if ours.tokens == base.tokens else f"TOKEN COUNTS DIFFER ({ours.tokens} vs {base.tokens})"
    print(
        f"\nrolledger overhead: {ours.tok_s / base.tok_s:.2f}x the direct rate "
        f"({(ours.seconds - base.seconds) / args.groups * 1e3:+.1f} ms per group; {same})"
    )
    print(
        f"prefill per group: {base.prefill_per_group:.1f} tokens with the prefix cache vs "
        f"{nocache.prefill_per_group:.1f} without ({base.prefill_per_group / nocache.prefill_per_group:.3f}x)"
    )
    print(
        f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
        f"(2 shared CPUs: other users' load moves these numbers)"
    )


if __name__ == "__main__":
    main()
