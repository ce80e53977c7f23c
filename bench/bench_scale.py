"""The control plane at scale (run by hand): what the control plane costs per event, with simulated engines.

    python bench/bench_scale.py [--prompts 512] [--samples 16] [--ranks 16 | --ranks64] [--steps 20] [--gen-ms 200]
                                [--gc serving | default | both] [--fold shared | own | both]

What runs, all in this process (as `rolledger run` runs it) against a real redis-server on loopback (AOF on,
appendfsync no, as rolledger runs it):

- the real coordinator (workers/roles/coordinator.py), the real rank workers with their rollout threads (workers/roles/rank.py,
  workers/roles/rollout.py), the real reward worker (workers/roles/reward.py, the addition checker on a real tokenizer);
- `SimulatedEngine` (one per rank, defined here): an Engine that generates nothing. A group costs declared time,
  `--gen-ms`, spent waiting on an event (no CPU), its samples ending one by one across that time (it streams, as
  TorchEngine does); each sample is one random digit and <eos> with logprob -2.3. Pause/commit/prepare are real in
  their bookkeeping; prepare reads the staged files through the verified path (workers.weights.staging_loader).
- `SimulatedTrainer` (defined here): the real trainer client (workers/roles/trainer_client.py: next_batch, agreement,
  publish) with no model: it reports the engine's own logprobs as its agreement, "trains" in zero time and stages
  a tiny state dict (4 float32 values) per version, so the update protocol (prepare, drain, commit, probe) runs for
  real with tiny weights.

Printed, measured between RunStarted and the run's end (setup excluded):

- control-plane CPU per event: user + system CPU of this process (getrusage; every role thread, live or ended)
  plus redis-server's (INFO cpu), divided by the events the run appended. The simulated engines and trainer sleep
  by waiting on events, which costs no CPU, so everything counted is control plane (the simulated trainer's
  staging of 16 bytes and the engines' verified reads of them included);
- Redis commands per event: INFO commandstats calls delta (commands run inside Lua scripts are counted there
  too) and client round trips (commands and pipelines/transactions sent by this process), each per event; and the
  log's entries (an entry holds one append's events, events/store.py), events per entry;
- log bytes per step (sum of the entries' field bytes, and MEMORY USAGE of the stream per step);
- the coordinator's decision latency: time of each `decide()` call on its thread, p50/p99;
- live state size (msgpack of the reducer state) and snapshot time (`take_snapshot`: digest + to_dict + msgpack +
  XADD) at the end of step 1 and of the last step (each at its TrainStepFinished) and at the run's end, on states
  refolded from the log after the run;
- the control-plane CPU per step as a fraction of a 21 s step (NeMo-RL's GRPO step at 512x16).

The machine may be shared: the load average is printed with the numbers.

`--gc`: the roles run inside `workers.runtime.gc_policy.serving()` as in `rolledger run` (serving, the default), or under
CPython's collector defaults (default, the baseline), or both, one whole run after the other (a fresh redis-server
each), each printed, then their ratio of control-plane CPU per event.

`--fold`: the ranks and the reward worker share the process's one fold of the log, as in `rolledger run`
(`workers.runtime.runtime.shared_follower`; shared, the default), or each folds it itself (own, the baseline: as before the
fold was shared, and as ranks in processes of their own do), or both, compared the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_replay import redis_server

import rolledger.workers.roles.coordinator as coordinator_module
import rolledger.workers.roles.rank as rank_module
import rolledger.workers.roles.reward as reward_module
from rolledger.events.connection import connect
from rolledger.events.envelope import make_event
from rolledger.events.snapshots import take_snapshot
from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
from rolledger.schemas.config import AdmissionConfig, RunConfig, SamplingParams, TaskConfig, TrainerConfig
from rolledger.schemas.weights import WeightManifest
from rolledger.workers.engines.protocol import (
    CommitReport,
    EngineCapabilities,
    GroupOutput,
    HealthReport,
    IllegalEngineOrder,
    SampleOutput,
    SleepReport,
    TensorSpec,
    WakeReport,
    refuse_unless_serving,
)
from rolledger.workers.operator.local_run import prompt_items
from rolledger.workers.policy.policy_model import build_tokenizer
from rolledger.workers.roles.coordinator import Coordinator
from rolledger.workers.roles.rank import RankWorker
from rolledger.workers.roles.reward import RewardWorker
from rolledger.workers.roles.trainer_api import RunOver
from rolledger.workers.roles.trainer_client import TrainerClient
from rolledger.workers.runtime import gc_policy
from rolledger.workers.runtime.runtime import LockedFollower, Worker
from rolledger.workers.weights.staging_loader import load_verified
from rolledger.workers.weights.tensors import state_digest
from rolledger.workers.weights.transport import open_trainer_store
from rolledger.workflows.reducer import fold
from rolledger.workflows.state import RunState

RUN_ID = "bench-scale"
STEP_S = 21.0  # a GRPO step at 512x16 (NeMo-RL), what the control plane's cost is compared with


def tiny_weights(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), float(version))}


class SimulatedEngine:
    """An Engine that generates nothing: a group costs `gen_s` of waiting (no CPU). See the module docstring."""

    def __init__(self, rank: int, gen_s: float, digit_ids: Sequence[int], eos_id: int) -> None:
        self.rank = rank
        self.gen_s = gen_s
        self.digit_ids = list(digit_ids)
        self.eos_id = eos_id
        self._rng = random.Random(rank)
        self._lock = threading.Condition()
        self._abort = threading.Event()
        self._paused: str | None = None
        self._inflight = 0
        self._version = 0
        self._digest = state_digest(tiny_weights(0))
        self._staged: tuple[int, str] | None = None
        self._cache_generation = 0

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            name="simulated", sleep_levels=(), prefix_cache=False, logprob_mode="raw", streams_samples=True
        )

    @property
    def policy_version(self) -> int:
        return self._version

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        n: int,
        sampling: SamplingParams,
        *,
        should_cancel: Callable[[int], bool] | None = None,
        on_sample: Callable[[int, SampleOutput], None] | None = None,
        expect_version: int | None = None,
    ) -> GroupOutput:
        with self._lock:
            if self._paused is not None:
                raise IllegalEngineOrder(f"rank {self.rank}: generate while paused")
            refuse_unless_serving(expect_version, self._version, self.rank)
            self._inflight += 1
        try:
            samples: list[SampleOutput] = []
            start = time.monotonic()
            for i in range(n):
                # the declared cost: wait (not compute) until this sample's end time
                self._abort.wait(max(0.0, start + self.gen_s * (i + 1) / n - time.monotonic()))
                if self._abort.is_set() or (should_cancel is not None and should_cancel(i)):
                    s = SampleOutput([], [], "abort")
                else:
                    s = SampleOutput([self._rng.choice(self.digit_ids), self.eos_id], [-2.3, -0.1], "stop")
                samples.append(s)
                if on_sample is not None and s.finish_reason != "abort":
                    on_sample(i, s)
            return GroupOutput(samples, self._version, self._digest, self._cache_generation, 0)
        finally:
            with self._lock:
                self._inflight -= 1
                self._lock.notify_all()

    def pause(self, mode: str) -> None:
        with self._lock:
            self._paused = mode
            if mode == "abort":
                self._abort.set()
            if mode != "keep":
                self._lock.wait_for(lambda: self._inflight == 0, timeout=30)

    def resume(self) -> None:
        with self._lock:
            self._paused = None
            self._abort.clear()

    @property
    def is_paused(self) -> bool:
        return self._paused is not None

    def sleep(self, level: int) -> SleepReport:
        raise IllegalEngineOrder("the simulated engine cannot sleep")

    def wake(self, tags: Sequence[str]) -> WakeReport:
        return WakeReport(tuple(tags), 0)

    @property
    def asleep_level(self) -> int:
        return 0

    def kv_cache_tokens(self) -> int | None:
        return None

    def live_tensor_specs(self) -> Mapping[str, TensorSpec]:
        return {"w": TensorSpec((4,), "float32")}

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> str:
        digest = state_digest(tensors)
        self._staged = (version, digest)
        return digest

    def commit_weights(self, version: int) -> CommitReport:
        if self._staged is None or self._staged[0] != version:
            raise IllegalEngineOrder(f"rank {self.rank}: commit v{version}, staged {self._staged}")
        self._version, self._digest = self._staged
        self._staged = None
        self._cache_generation += 1
        return CommitReport(version, self._digest, self._cache_generation, 0, False)

    def prepare(self, version: int, uri: str, manifest: WeightManifest) -> str:
        return self.stage_weights(version, dict(load_verified(uri, version, manifest)))

    @property
    def cache_generation(self) -> int:
        return self._cache_generation

    @property
    def graph_generation(self) -> int:
        return 0

    def discard_weights(self) -> None:
        self._staged = None

    def reset_prefix_cache(self) -> int:
        self._cache_generation += 1
        return self._cache_generation

    def weights_digest(self) -> str:
        return self._digest

    def health(self) -> HealthReport:
        return HealthReport(ok=True, detail="simulated", probe_digest=self._digest)

    def close(self) -> None:
        self._abort.set()


class SimulatedTrainer(Worker):
    """The real trainer client with no model: agreement from the engine's own logprobs, zero-time training, a tiny
    state dict staged per version (see the module docstring)."""

    kind = "trainer"

    def __init__(self, client: redis.Redis, run_id: str, staging_root: Path, cfg: RunConfig) -> None:
        super().__init__(client, run_id, "trainer")
        self.seat = TrainerClient(
            client, run_id, "trainer", open_trainer_store(cfg, staging_root), stop=self.stop_event
        )

    def run(self) -> None:
        weights = tiny_weights(0)
        while not self.stop_event.is_set():
            try:
                batch = self.seat.next_batch(weights)
            except RunOver:
                return
            if batch is None:
                return
            self.seat.agreement(batch, [list(t.logprobs) for t in batch.on_policy_trajectories])
            weights = tiny_weights(batch.version)
            stats = SimpleNamespace(
                loss=0.0, reward_mean=statistics.fmean(batch.rewards), max_seq_ratio=1.0, clipped_frac=0.0
            )
            self.seat.publish(batch, weights, stats, wait=False)


class RoundTrips:
    """Counts what this process sends to Redis: one per command, one per pipeline or transaction."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._originals: list[tuple[type, str, Any]] = []

    def install(self) -> None:
        import redis.client

        def wrap(cls: type, name: str) -> None:
            original = getattr(cls, name)

            def counted(obj: Any, *args: Any, **kwargs: Any) -> Any:
                with self._lock:
                    self.count += 1
                return original(obj, *args, **kwargs)

            self._originals.append((cls, name, original))
            setattr(cls, name, counted)

        wrap(redis.client.Redis, "_execute_command")
        wrap(redis.client.Pipeline, "_execute_transaction")
        wrap(redis.client.Pipeline, "_execute_pipeline")

    def uninstall(self) -> None:
        for cls, name, original in self._originals:
            setattr(cls, name, original)


class RoleCpu:
    """CPU per role: each thread's own CPU time (time.thread_time) when it ends, summed by its name with the numbers
    taken out (`rank-3-rollout` and `rank-12-rollout` are one role, `rank-N-rollout`). Every thread the run starts
    ends before the bench reads the totals (the workers are joined); the main thread's share is the process's CPU
    less the threads'."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self._lock = threading.Lock()
        self._original: Any = None

    @staticmethod
    def role(name: str) -> str:
        return re.sub(r"\d+", "N", name.partition("#")[0])

    def install(self) -> None:
        original = self._original = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

        def counted(thread: threading.Thread) -> None:
            try:
                original(thread)
            finally:
                spent = time.thread_time()
                with self._lock:
                    role = self.role(thread.name)
                    self.cpu[role] = self.cpu.get(role, 0.0) + spent

        threading.Thread._bootstrap_inner = counted  # type: ignore[attr-defined]

    def uninstall(self) -> None:
        threading.Thread._bootstrap_inner = self._original  # type: ignore[attr-defined]

    def totals(self) -> dict[str, float]:
        """Ended threads as counted, plus the threads still alive (daemons) read from /proc."""
        out = dict(self.cpu)
        tick = os.sysconf("SC_CLK_TCK")
        for thread in threading.enumerate():
            if thread is threading.main_thread() or thread.native_id is None:
                continue
            try:
                fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            role = self.role(thread.name)
            out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        return out


def command_calls(client: redis.Redis) -> dict[str, int]:
    stats: Any = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def redis_cpu(client: redis.Redis) -> float:
    info: Any = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def percentile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def config(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        steps=args.steps,
        ranks=args.ranks,
        group_size=args.samples,
        task=TaskConfig(num_prompts=max(64, args.prompts)),
        trainer=TrainerConfig(groups_per_step=args.prompts, warm_start_steps=0),
        admission=AdmissionConfig(
            max_inflight_groups=args.prompts, max_queued_bytes=1 << 30, max_lag=1, throttle_to_drain_rate=False
        ),
        run_deadline_s=args.deadline_s,
    )


def snapshot_cost(client: redis.Redis, state: RunState, stream_id: str) -> tuple[int, float]:
    started = time.perf_counter()
    snap = take_snapshot(client, RUN_ID + "-snapshots", state, stream_id)
    return len(snap.state), time.perf_counter() - started


def after_the_run(client: redis.Redis, steps: int) -> dict[str, Any]:
    """Refold the log: state size and snapshot time at the end of every trainer step (its TrainStepFinished: the same
    point of each step, so step 1 and the last step compare like with like) and at the run's end; log bytes."""
    log = EventLog(client, RUN_ID)
    state = RunState()
    out: dict[str, Any] = {}
    per_step: list[tuple[int, float]] = []
    beside_groups: list[int] = []  # the state less its live groups (the open work, which timing decides)
    last = "0-0"
    snapshot_cost(client, RunState(), "0-1")  # warm-up: the first snapshot pays one-time costs (300 ms seen)
    for stored in log.read():
        fold(state, stored.event)
        last = stored.stream_id
        if isinstance(stored.event.payload, ev.TrainStepFinished):
            per_step.append(snapshot_cost(client, state, last))
            data = state.to_dict()
            beside_groups.append(len(msgpack.packb({k: v for k, v in data.items() if k != "groups"})))
    if per_step:
        out["step1"], out["last"] = per_step[0], per_step[-1]
        out["per_step_kb"] = [round(size / 1e3) for size, _ in per_step]
        out["beside_groups_kb"] = [round(size / 1e3, 1) for size in beside_groups]
    out["end"] = snapshot_cost(client, state, last)
    raw = 0
    lo = "-"
    while True:
        page: Any = client.xrange(log.key, lo, "+", count=5000)
        if not page:
            break
        raw += sum(len(k) + len(v) for _, fields in page for k, v in fields.items())
        if len(page) < 5000:
            break
        lo = "(" + page[-1][0].decode()
    out["log_bytes_per_step"] = raw / steps
    out["stream_memory_per_step"] = int(client.memory_usage(log.key) or 0) / steps  # type: ignore[arg-type]
    return out


def own_follower(log: EventLog) -> LockedFollower:
    """`--fold own`: a fold of the log for one role alone (as a role in a process of its own has)."""
    return LockedFollower(log)


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = config(args)
    tokenizer = build_tokenizer()
    digit_ids = [int(tokenizer.convert_tokens_to_ids(str(d))) for d in range(10)]  # type: ignore[arg-type]
    decide_ms: list[float] = []
    real_decide = coordinator_module.decide

    def timed_decide(*a: Any, **kw: Any) -> Any:
        started = time.perf_counter()
        try:
            return real_decide(*a, **kw)
        finally:
            decide_ms.append((time.perf_counter() - started) * 1e3)

    coordinator_module.decide = timed_decide  # type: ignore[assignment]
    shared = rank_module.shared_follower
    if args.fold == "own":  # the baseline: every rank and the reward worker fold the log themselves
        rank_module.shared_follower = reward_module.shared_follower = own_follower  # type: ignore[assignment]
    trips = RoundTrips()
    roles = RoleCpu()
    roles.install()  # before any worker exists: some start threads as they are made
    with (
        redis_server(aof=True) as (url, _),
        tempfile.TemporaryDirectory(prefix="rl-scale-") as tmp,
        contextlib.ExitStack() as collector,
    ):
        client = connect(url)
        log = EventLog(client, RUN_ID)
        prompts = prompt_items(cfg, tokenizer)
        workers: list[Worker] = [Coordinator(client, RUN_ID, "coordinator", prompts)]
        for r in range(cfg.ranks):
            engine = SimulatedEngine(r, args.gen_ms / 1e3, digit_ids, int(tokenizer.eos_token_id))
            workers.append(RankWorker(client, RUN_ID, r, engine, initial_weights=lambda: tiny_weights(0)))  # type: ignore[arg-type]
        workers.append(RewardWorker(client, RUN_ID, "reward", tokenizer))
        workers.append(SimulatedTrainer(client, RUN_ID, Path(tmp) / "staging", cfg))
        if (
            args.gc == "serving"
        ):  # as `rolledger run` does: the roles as built are frozen (workers/runtime/gc_policy.py)
            collector.enter_context(gc_policy.serving())
        calls0, rcpu0, cpu0 = command_calls(client), redis_cpu(client), own_cpu()
        trips.install()
        t0 = time.perf_counter()
        started = make_event(
            ev.RunStarted(config=cfg, initial_weights_digest=state_digest(tiny_weights(0)), model_dir=tmp),
            run_id=RUN_ID,
            producer="bench",
            policy_version=0,
        )
        log.append(started)
        for w in workers:
            w.start()
        give_up = time.monotonic() + args.deadline_s + 60
        while log.finished_at() is None and time.monotonic() < give_up:
            time.sleep(0.5)  # the bench's own wait: one GET per half second
        wall = time.perf_counter() - t0
        for w in workers:
            w.stop()
        for w in workers:
            w.join(timeout=30)
        trips.uninstall()
        roles.uninstall()
        cpu, rcpu, calls = own_cpu() - cpu0, redis_cpu(client) - rcpu0, command_calls(client)
        entries = log.length()
        delta = {k: v - calls0.get(k, 0) for k, v in calls.items() if v - calls0.get(k, 0) > 0}
        state = RunState()
        for stored in log.read():
            fold(state, stored.event)
        events = int(state.events_applied)  # an entry holds one append's events
        post = after_the_run(client, args.steps)  # snapshots timed under the collector the run had, as a process does
        collector.close()
    coordinator_module.decide = real_decide  # type: ignore[assignment]
    rank_module.shared_follower = reward_module.shared_follower = shared  # type: ignore[assignment]
    return {
        "events": events,
        "entries": entries,
        "status": str(state.status),
        "steps_done": state.step if hasattr(state, "step") else None,
        "wall_s": wall,
        "cpu_s": cpu,
        "redis_cpu_s": rcpu,
        "commands": sum(delta.values()),
        "top_commands": sorted(delta.items(), key=lambda kv: -kv[1])[:14],
        "round_trips": trips.count,
        "decide_ms": decide_ms,
        "roles": roles.totals(),
        **post,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=512, help="groups per step (trainer.groups_per_step)")
    p.add_argument("--samples", type=int, default=16, help="samples per group (group_size)")
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--ranks64", action="store_true", help="64 ranks")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--gen-ms", type=float, default=200.0, help="declared generation time of one group")
    p.add_argument(
        "--gc",
        choices=("serving", "default", "both"),
        default="serving",
        help="the collector as `rolledger run` sets it (workers/runtime/gc_policy.py), CPython's defaults (the baseline), "
        "or both, one run after the other, with their ratio",
    )
    p.add_argument(
        "--fold",
        choices=("shared", "own", "both"),
        default="shared",
        help="the ranks and the reward worker share the process's fold (workers/runtime/runtime.py shared_follower), each "
        "folds the log itself (the baseline), or both, one run after the other, with their ratio",
    )
    p.add_argument("--deadline-s", type=float, default=1800.0, help="the run's deadline")
    args = p.parse_args()
    if args.ranks64:
        args.ranks = 64
    if args.gc == "both" and args.fold == "both":
        p.error("--gc both and --fold both: compare one thing at a time")
    key, pair = ("gc", ["default", "serving"]) if args.gc == "both" else ("fold", ["own", "shared"])
    variants = pair if getattr(args, key) == "both" else [getattr(args, key)]
    results = []
    for variant in variants:
        run_args = argparse.Namespace(**{**vars(args), key: variant})
        r = run(run_args)
        report(run_args, r)
        results.append((r["cpu_s"] + r["redis_cpu_s"]) / r["events"] * 1e6)
    if len(results) == 2:
        base, tuned = results
        print(
            f"{key}: {variants[1]} {tuned:.1f} vs {variants[0]} {base:.1f} us/event of control-plane CPU "
            f"({tuned / base:.2f}x, same machine, one run after the other)"
        )


def report(args: argparse.Namespace, r: dict[str, Any]) -> None:
    events, steps = r["events"], args.steps
    total_cpu = r["cpu_s"] + r["redis_cpu_s"]
    per_step_cpu = total_cpu / steps
    load = os.getloadavg()
    print(
        f"bench_scale: {args.prompts} prompts x {args.samples} samples, {args.ranks} ranks, {steps} steps, "
        f"gen {args.gen_ms:g} ms/group, collector {args.gc}, fold {args.fold} (simulated engines and trainer, real "
        "control plane and redis-server)"
    )
    print(
        f"  run ended {r['status']} after {r['wall_s']:.1f} s; {events} events ({events / steps:.0f}/step) in "
        f"{r['entries']} log entries ({events / r['entries']:.1f} events/entry); load average {load[0]:.2f} {load[1]:.2f}"
    )
    print(
        f"  control-plane CPU      {total_cpu:8.2f} s = {total_cpu / events * 1e6:9.1f} us/event "
        f"(workers {r['cpu_s'] / events * 1e6:.1f}, redis-server {r['redis_cpu_s'] / events * 1e6:.1f})"
    )
    print(
        f"  redis commands         {r['commands'] / events:8.2f} /event (commandstats, script-inner included); "
        f"round trips {r['round_trips'] / events:.2f} /event"
    )
    threads = sum(r["roles"].values())
    by_role = sorted({**r["roles"], "main and setup": r["cpu_s"] - threads}.items(), key=lambda kv: -kv[1])
    print("    by role (us/event): " + ", ".join(f"{k} {v / events * 1e6:.1f}" for k, v in by_role[:10]))
    print("    top: " + ", ".join(f"{k} {v / events:.2f}" for k, v in r["top_commands"]))
    print(
        f"  log bytes per step     {r['log_bytes_per_step'] / 1e6:8.2f} MB (fields); stream memory "
        f"{r['stream_memory_per_step'] / 1e6:.2f} MB/step"
    )
    d = r["decide_ms"]
    print(
        f"  coordinator decide()   p50 {percentile(d, 0.5):.2f} ms, p99 {percentile(d, 0.99):.2f} ms "
        f"over {len(d)} ticks"
    )
    for label, key in (("step 1", "step1"), ("last step", "last"), ("run's end", "end")):
        if key in r:
            size, secs = r[key]
            print(f"  state at {label:9s}     {size / 1e6:8.2f} MB msgpack; snapshot {secs * 1e3:.1f} ms")
    if "last" in r:
        (size1, secs1), (size_n, secs_n) = r["step1"], r["last"]
        print(
            f"  last step / step 1       state {size_n / size1:.2f}x, snapshot {secs_n / secs1:.2f}x (aim <= 1.2x); "
            f"state at each step's end, kB: {r['per_step_kb']}"
        )
        print(f"  state less its live groups (what is not open work), kB at each step's end: {r['beside_groups_kb']}")
    print(
        f"  control plane per step {per_step_cpu:8.2f} s CPU = {per_step_cpu / STEP_S * 100:.1f}% of a "
        f"{STEP_S:g} s step"
    )


if __name__ == "__main__":
    main()
