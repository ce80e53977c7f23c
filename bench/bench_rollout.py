"""Benchmark of rollout through rolledger (run by hand): a RankWorker on a real redis-server vs the engine called directly.

    python bench/bench_rollout.py [--groups 16] [--n 8] [--max-tokens 16] [--fewshot 6] [--threads 1] [--slots 4]
                                  [--queued 0] [--engine-process] [--no-aof] [--rounds 15]

Workload (as bench/bench_engine.py): `--groups` prompts "<few-shot prefix> a+b=" on the tiny policy
(workers.policy.policy_model, default ModelConfig with positions widened to fit), `--n` samples per group, `--max-tokens`,
temperature 1, seed = group index, so both paths sample exactly the same tokens (checked: the totals must match).

Measured side by side in one process, each path on its own TorchEngine over the same weights, warmed up the same way,
in `--rounds` interleaved rounds (direct, rolledger, direct, rolledger, ...: this machine's speed drifts by tens of
percent between runs a minute apart, so the two paths are always compared within one round, and the median of the
per-round ratios is reported):

  direct          engine.generate(prompt, n, sampling) for every group, from `--slots` + `--queued` threads at once
                  (each takes the next group when it is done with one; 1: a plain loop): the baseline. With more than
                  one in flight both engines batch the groups into one decode step (TorchEngine(batch_groups=True),
                  what a run with rank_slots > 1 builds), at most `--slots` a step (max_batch_groups; `--queued` more
                  wait in the engine for room, as a run with torch_engine.max_batch_groups below rank_slots does);
                  --one-group-per-step decodes one group at a time on both;
  rolledger       a RankWorker (workers/roles/rank.py) with `rank_slots = --slots + --queued` (the same concurrency), its
                  engine in the worker's process or, with --engine-process, in a process of its own
                  (workers/engines/engine_process, torch_engine.process; direct's engine stays in-process), on its own
                  redis-server (AOF, appendfsync no as rolledger runs it, unless --no-aof), joined once for all
                  rounds. A round appends its G GroupAdmitted events (one MULTI/EXEC) and waits until the log holds a
                  SampleFinished for every sample. Its time is read from Redis's own clock, so the watcher cannot
                  stretch it: from the GroupAdmitted batch's stream id to the last SampleFinished's (stream ids are
                  milliseconds); the watcher reads only the `t` field's worth (it decodes nothing) and polls every
                  50 ms instead of waking on every append. It includes everything the worker does per group:
                  work-stream read, following the log, SampleStarted x n, generation, SampleFinished x n (encode +
                  append), ack;
  direct, no cache  TorchEngine(prefix_cache=False), once, for the prefill comparison.

Printed: generated tokens/s of each path per round and the median ratio rolledger/direct (1.00 = free), the overhead
in ms per group, where that overhead goes (CPU seconds of the rank worker's own threads, read from /proc, beside how
much longer its engine's decode steps took than direct's, and how many groups a decode step held on each path), and
the prompt tokens prefilled per group with the prefix cache vs without. The machine is shared: the load average is
printed with them.

What the flags show (bench table in docs/performance.md): in-process, the worker's threads hold the engine's GIL, and that
time is added to the decode steps one for one; --engine-process removes that (the steps take what direct's take),
leaving the time a slot spends between two groups (logging the finished one, taking the next: a few ms), when the
engine holds one group fewer; --queued keeps a request waiting in the engine for that time, and --groups 64 makes
each round's fill and drain (the first group's way in, the last one's way out) a smaller share of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
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
from rolledger.workers.engines.engine_process import EngineProcess
from rolledger.workers.engines.torch_engine import TorchEngine
from rolledger.workers.policy.policy_model import build_model, build_tokenizer, policy_state
from rolledger.workers.roles.rank import RankWorker
from rolledger.workers.weights.tensors import state_digest
from rolledger.workflows.admission import sample_reserve
from rolledger.workflows.scheduler import PromptItem

RUN_ID = "bench-rollout"
CountedEngine = TorchEngine | EngineProcess  # an engine with stats


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


def direct(
    name: str, engine: CountedEngine, prompts: list[list[int]], n: int, max_tokens: int, slots: int = 1
) -> Result:
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


def thread_cpu_s(prefix: str) -> float:
    """CPU seconds (user + system, from /proc: Linux) of this process's live threads whose name starts with prefix."""
    total = 0
    for t in threading.enumerate():
        if t.name.startswith(prefix) and t.native_id is not None:
            try:
                stat = Path(f"/proc/self/task/{t.native_id}/stat").read_text()
            except OSError:  # ended meanwhile
                continue
            fields = stat.rsplit(")", 1)[1].split()  # after the command name: field 3 (state) is fields[0]
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


def ms_of(stream_id: str | bytes) -> int:
    """The millisecond part of a stream id (Redis's clock when the entry was added)."""
    text = stream_id.decode() if isinstance(stream_id, bytes) else stream_id
    return int(text.partition("-")[0])


def wait_for_type(client: redis.Redis, key: str, after: str, type_: bytes, count: int, deadline_s: float) -> str:
    """Poll (every 50 ms: the round's time comes from stream ids, not from when this loop wakes) until the stream
    holds `count` events of `type_` after `after`, counted from each entry's `t` field (nothing decoded); return the
    id of the entry holding the last one.

    An append is one log entry (events/store.py): an entry of several events has `t` = their types comma-joined
    ("SampleFinished,SampleFinished,..."), so the types are counted in it, not compared with it whole (comparing
    whole, a group whose n samples end in one append was never counted and the wait ran out its deadline)."""
    seen, last = 0, after
    deadline = time.monotonic() + deadline_s
    cursor: str | bytes = after
    while seen < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out: {seen} of {count} {type_.decode()} after {deadline_s:.0f} s")
        # a sync client without decode_responses: [(stream, [(entry_id, fields)])] (redis-py types it Any | Awaitable)
        reply = cast(XReadReply, client.xread({key: cursor}, count=10_000))
        for _, entries in reply or []:
            for entry_id, fields in entries:
                cursor = entry_id
                held = fields.get(b"t", b"").split(b",").count(type_)
                if held:
                    seen, last = seen + held, entry_id.decode()
        if seen < count:
            time.sleep(0.05)  # a poll interval, not synchronisation: the measured span is read from stream ids
    return last


class ThroughRolledger:
    """One RankWorker on its own engine and redis-server, joined once; `round` generates the prompts through it."""

    def __init__(
        self, url: str, engine: CountedEngine, model: torch.nn.Module, cfg: RunConfig, deadline_s: float
    ) -> None:
        self.client = connect(url)
        self.log = EventLog(self.client, RUN_ID)
        self.engine, self.cfg, self.deadline_s = engine, cfg, deadline_s
        self.rounds = 0
        self.log.append(
            make_event(
                ev.RunStarted(config=cfg, initial_weights_digest=state_digest(policy_state(model))),
                run_id=RUN_ID,
                producer="bench",
                policy_version=0,
            )
        )
        self.worker = RankWorker(self.client, RUN_ID, 0, engine)
        self.worker.start()
        wait_for_type(self.client, self.log.key, "0-0", b"RankJoined", 1, deadline_s)

    def round(self, prompts: list[list[int]]) -> Result:
        n, max_tokens = self.cfg.group_size, self.cfg.sampling.max_tokens
        self.rounds += 1
        admitted = [
            make_event(
                ev.GroupAdmitted(
                    group_id=f"r{self.rounds}g{g:06d}",
                    prompt_id=f"p{g}",
                    prompt_token_ids=ids,
                    n=n,
                    sampling=sampling_for(g, max_tokens),
                    partial_policy=self.cfg.partial_policy,
                    answer="0",
                    est_remaining_tokens=n * max_tokens,
                    est_bytes=n
                    * sample_reserve(
                        f"r{self.rounds}g{g:06d}",
                        PromptItem(g, f"p{g}", tuple(ids), "0"),
                        n,
                        sampling_for(g, max_tokens),
                        False,
                    ),
                    queued_bytes=0,
                    byte_cap=10**12,
                ),
                run_id=RUN_ID,
                producer="bench",
                policy_version=0,
            )
            for g, ids in enumerate(prompts)
        ]
        before = self.engine.stats.prefill_tokens_computed
        ids = self.log.append_many(admitted)
        last = wait_for_type(self.client, self.log.key, ids[-1], b"SampleFinished", len(prompts) * n, self.deadline_s)
        if self.worker.error is not None:
            raise SystemExit(f"rank worker failed: {self.worker.error!r}")
        tokens = 0
        for stored in self.log.read("(" + ids[-1], last, types={"SampleFinished"}):
            assert isinstance(stored.event.payload, ev.SampleFinished)
            tokens += len(stored.event.payload.trajectory.token_ids)
        seconds = (ms_of(last) - ms_of(ids[0])) / 1e3
        return Result("rolledger", seconds, tokens, self.engine.stats.prefill_tokens_computed - before, len(prompts))

    def close(self) -> None:
        self.worker.stop()
        self.worker.join(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=16, help="groups per round")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--fewshot", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--slots", type=int, default=4, help="groups the engine decodes at once (its max_batch_groups)")
    ap.add_argument(
        "--queued",
        type=int,
        default=0,
        help="requests each path keeps in flight beyond --slots, waiting in the engine for room (direct's threads and "
        "the rank's rank_slots are both --slots + --queued); 0: exactly --slots in flight",
    )
    ap.add_argument(
        "--one-group-per-step",
        action="store_true",
        help="both engines decode one group at a time (default with --slots > 1: groups share each decode step, as a "
        "run with rank_slots > 1 does)",
    )
    ap.add_argument(
        "--engine-process",
        action="store_true",
        help="the rank worker's engine runs in a process of its own (workers/engines/engine_process; direct stays "
        "in-process): the worker's threads no longer share the engine's interpreter",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-aof", action="store_true", help="redis without persistence (default: AOF, appendfsync no)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds of each path (median reported)")
    ap.add_argument(
        "--deadline-s", type=float, default=120.0, help="give up waiting for a round of the worker after this (seconds)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tok = build_tokenizer()
    prompts = [list(tok(t)["input_ids"]) for t in make_prompts(args.groups, args.fewshot, args.seed)]
    warm = [list(tok(t)["input_ids"]) for t in make_prompts(2, args.fewshot, args.seed + 1)]
    model_cfg = ModelConfig(max_position_embeddings=max(64, max(map(len, prompts + warm)) + args.max_tokens))
    in_flight = args.slots + args.queued
    cfg = RunConfig(
        group_size=args.n, rank_slots=in_flight, model=model_cfg, sampling=SamplingParams(max_tokens=args.max_tokens)
    )

    batch = in_flight > 1 and not args.one_group_per_step
    limit = args.slots if batch else None

    def engine(prefix_cache: bool = True, process: bool = False) -> tuple[CountedEngine, torch.nn.Module]:
        model = build_model(model_cfg, len(tok), args.seed)
        e: CountedEngine = (
            EngineProcess(
                partial(TorchEngine, model, tok, batch_groups=batch, max_batch_groups=limit), torch_threads=args.threads
            )
            if process
            else TorchEngine(model, tok, prefix_cache=prefix_cache, batch_groups=batch, max_batch_groups=limit)
        )
        direct("warmup", e, warm, args.n, args.max_tokens)  # same warm-up for every engine: same cache state after
        return e, model

    load_before = os.getloadavg()
    nocache = direct("direct, no cache", engine(prefix_cache=False)[0], prompts, args.n, args.max_tokens, in_flight)
    direct_engine = engine()[0]
    pairs: list[tuple[Result, Result]] = []
    with redis_server(aof=not args.no_aof) as (url, _):
        e, model = engine(process=args.engine_process)
        ours = ThroughRolledger(url, e, model, cfg, args.deadline_s)
        try:
            steps_before = {name: dict(eng.stats.extra) for name, eng in (("direct", direct_engine), ("rolledger", e))}
            cpu_before = thread_cpu_s("rank-")
            for _ in range(args.rounds):
                base = direct("direct", direct_engine, prompts, args.n, args.max_tokens, in_flight)
                pairs.append((base, ours.round(prompts)))
            worker_cpu = thread_cpu_s("rank-") - cpu_before
            steps_after = {name: dict(eng.stats.extra) for name, eng in (("direct", direct_engine), ("rolledger", e))}
        finally:
            ours.close()
            if isinstance(e, EngineProcess):
                e.close()
    load_after = os.getloadavg()

    print(
        f"\ngroups={args.groups} n={args.n} prompt tokens~{sum(map(len, prompts)) / len(prompts):.1f} "
        f"max_tokens={args.max_tokens} slots={args.slots} queued={args.queued} batch_groups={batch} torch threads={args.threads} "
        f"redis aof={'off' if args.no_aof else 'appendfsync no'} rounds={args.rounds} (direct, rolledger alternating)"
    )
    print(f"{'round':<6} {'direct tok/s':>13} {'rolledger tok/s':>16} {'ratio':>7} {'ms/group':>9}")
    ratios, overheads = [], []
    for k, (base, mine) in enumerate(pairs, 1):
        ratio = mine.tok_s / base.tok_s
        extra = (mine.seconds - base.seconds) / args.groups * 1e3
        ratios.append(ratio)
        overheads.append(extra)
        same = "" if mine.tokens == base.tokens else f"  TOKEN COUNTS DIFFER ({mine.tokens} vs {base.tokens})"
        print(f"{k:<6} {base.tok_s:>13.0f} {mine.tok_s:>16.0f} {ratio:>6.2f}x {extra:>+9.1f}{same}")
    cold = pairs[0][0]  # round 1: the prompts not yet in the prefix cache (later rounds find them there)
    print(
        f"\nrolledger overhead: median {statistics.median(ratios):.2f}x the direct rate "
        f"({statistics.median(overheads):+.1f} ms per group), over {len(pairs)} rounds"
    )
    if batch:
        both = list(steps_after.items())
        print(
            "groups per decode step (mean over the run; the most at once; ms per step): "
            + ", ".join(
                f"{name} {x['batch_mean_groups']:.2f} ({x['batch_max_groups']:.0f}; {x['batch_step_ms']:.2f} ms)"
                for name, x in both
            )
        )
        steps = {k: steps_after[k]["batch_steps"] - steps_before[k]["batch_steps"] for k in steps_after}
        step_ms = {
            k: 1e3 * (steps_after[k]["batch_step_s"] - steps_before[k]["batch_step_s"]) / steps[k] for k in steps
        }
        excess = (step_ms["rolledger"] - step_ms["direct"]) * steps["rolledger"] / 1e3
        groups = args.rounds * args.groups
        print(
            f"where the overhead goes: the rank worker's own threads (control, rollout slots, heartbeats) used "
            f"{worker_cpu:.2f} s of CPU over the rolledger rounds ({worker_cpu / groups * 1e3:.2f} ms per group); "
            f"its engine's decode steps took {step_ms['rolledger'] - step_ms['direct']:+.2f} ms each beside direct's "
            f"({step_ms['rolledger']:.2f} vs {step_ms['direct']:.2f} ms), {excess:.2f} s over its {steps['rolledger']:.0f} "
            + (
                "steps: the engine runs in a process of its own, beside those threads; what is left is a step "
                "holding fewer groups (above)"
                if args.engine_process
                else "steps: the engine runs in the worker's interpreter, so the time those threads hold the GIL is "
                "added to the decode steps"
            )
        )
    print(
        f"prefill per group (round 1): {cold.prefill_per_group:.1f} tokens with the prefix cache vs "
        f"{nocache.prefill_per_group:.1f} without ({cold.prefill_per_group / nocache.prefill_per_group:.3f}x)"
    )
    print(
        f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
        f"(2 shared CPUs: other users' load moves these numbers)"
    )


if __name__ == "__main__":
    main()
