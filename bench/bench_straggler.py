"""Synchronous vs asynchronous RL on a heavy-tailed workload, on the SIMULATED engine (run by hand).

    python bench/bench_straggler.py [--steps 10] [--time-scale 0.05] [--train-s 45 --train-s 5] [--ranks 2]
                                    [--slots 4] [--only NAME ...]

Everything goes through the real control plane: one redis-server started here on a free loopback port, and per
configuration a fresh `rolledger run` (workers/local_run.LocalRun, external trainer) with a fresh run id, the same
seed and the same workload. Only the engine is simulated (workers/engines/simulated_engine.py, `engine =
"simulated"`): tokens cost declared time, not a model's compute. The trainer is simulated too: a loop on the real
trainer API (rolledger.client.TrainerClient) that takes each batch, spends a declared train time, changes the tiny
policy's weights a little (so the update transaction is real: staged, prepared with checksums, committed, probed)
and publishes the version. Agreement is NOT measured (simulated): the simulated engine's logprobs are not a model's,
so the trainer hands the engine's own logprobs back to the agreement gate (the log's TrainStepFinished then says a
gap of 0; read nothing into it).

Declared workload (times before `--time-scale`, which multiplies every one of them, decode and train alike):
a 45 ms decode step per token for every sequence in flight on a rank (continuous batching), 0.2 ms of prefill per
prompt token, sample lengths lognormal with median 200 tokens and sigma 1.0 (0.6 of it the prompt's own factor,
what a length estimate can learn; 0.8 the sample's), capped at 4,000 tokens (max_tokens); groups of 8 samples,
8 groups per trainer step; `--train-s` of training per step; every rank's engine decodes at most `--slots` x 8
sequences at once (simulated.max_num_seqs: the declared inference capacity, the same for all configurations), and
`--ranks` x `--slots` groups generate at once in every configuration counting capacity in groups (a straggler holds
its group's slot). Two workloads by default, each every configuration: `--train-s 45` (train-bound: the trainer's
declared time is the longer) and `--train-s 5` (generation-bound); `--train-s X` runs only that one.

Configurations (admission's rate throttle off in all but async+t+i and async+yc+i: the lag cap is the bound on
staleness):

  synchronous     admission.max_lag = 0: the groups of step s+1 are admitted only once version s is published, so
                  the engines generate one whole batch, wait while it is trained on and the update lands, and repeat
                  (generate a whole batch, train, repeat). Drain "wait".
  one-step-off    max_lag = 1: the next batch generates while the trainer trains on this one; drain "wait" (an
                  update waits for the generations in flight).
  async           max_lag = --lag-cap (4): generation runs up to 4 versions ahead; drain "wait".
  async+srgf+i    max_lag = --lag-cap, scheduler "srgf" (shortest estimated group first, fairness bound
                  admission.max_wait_rounds), and interruptible generation (update.drain_mode "keep": in-flight
                  samples park during the update and continue under the new version, each token stamped with its
                  version), and the trainer trains step s+1 beside the open update of step s
                  (trainer.overlap_update); every sample of a group is trained on.
  async+t+i       as async+srgf+i, but FIFO and with admission's rate throttle on (the baseline of the next row).
  async+yc+i      as async+t+i, but scheduler "youngest-cancel" (prime-rl's overload policy: FIFO, and when the
                  untrained groups outnumber the rate throttle's cap, its overload signal, the youngest open ones are
                  cancelled).
  async+srgf+kN+i max_lag = --lag-cap, scheduler "srgf" (shortest estimated group first, fairness bound
                  admission.max_wait_rounds), partial_policy first_k k=6 of 8 (the stragglers are cancelled), and
                  interruptible generation (update.drain_mode "keep": in-flight samples park during the update and
                  continue under the new version, each token stamped with its version), with the overlap above.
  async+srgf+i+s  as async+srgf+i, with the rank's capacity counted in sequences (rank_capacity "sequences"): a rank
                  takes another group while its engine has room for its 8 sequences beside those still generating
                  (up to --slots x 8, the same engine), so a straggler holds one sequence, not a group's slot (up to
                  --slots x 4 groups in flight a rank; admission.max_inflight_groups raised to match).
  async+srgf+a    as async+srgf+i, but each update cuts the samples in flight short (update.drain_mode "abort"):
                  they are cancelled, their groups replaced (the tokens they had are wasted).
  async+srgf+a+r  as async+srgf+a, with recycle_aborted: each cut sample is continued from its own tokens under the
                  new version, each stretch stamped with its version (nothing is wasted but what the run's end cuts).

Measured from each run's log (window: first GroupAdmitted to last BatchConsumed): trained samples per second
(BatchConsumed) and its ratio to synchronous, trainer-idle fraction (1 - simulated train time / window), rollout-idle
fraction (per rank, the part of the window with no group of it generating: SampleStarted to its last sample's end,
averaged over ranks), mean and max lag of the trained groups (BatchConsumed.lags) against the cap, and tokens wasted
by cancellation (from the log: the tokens of every sample cancelled mid-generation, SampleCancelled.tokens; a
recycled sample's tokens are kept, not wasted), with the tokens the engines generated.

The bound (per configuration, from what it trained; `bound s`, and `of bound` = bound / window): the shortest
window any schedule could reach for the same trained samples, given the declared capacity and train time. With
C = ranks x max_num_seqs sequences decoding at once, one token each per decode step d (scaled), the engines make at
most C / d tokens per second, and a sample of L tokens takes at least L x d (its tokens come one per step):

  generation-bound  G = max(trained tokens / (C / d), longest trained sample x d)
                    (every trained token is generated inside the window; prefill runs beside the decode and is
                    left out, so this is a lower bound);
  train-bound       R = F + (steps - 1) x t, t the declared train time per step, F the first batch's shortest
                    generation: max(its tokens / (C / d), its longest sample x d) (the window ends at the last
                    BatchConsumed; the trainer takes batch k+1 only after training batch k for t);
  bound             max(G, R): the larger wins.

Tokens generated but not trained (cut, cancelled, still in flight at the end) are not counted in G: no schedule needs
them. The bound is a lower bound on the window, so `of bound` is at most 1.00 (up to the clock's resolution).

Then the straggler scenario: one group of 8 with lengths given per sample, 7 x 200 + 1 x 4,000 tokens, run twice:
all 8 required, and first 7 of 8. Printed: when the seven short samples finished, when the group ended (the rank's
slot is free again), and the bubble (all-8 group end minus first-7 group end) next to the arithmetic (declared step x
3,800 tokens, in scaled time), with their ratio.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_replay import redis_server

from rolledger.client import TrainerClient, UpdateFailed, policy_weights
from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.workers.engines.simulated_engine import SimulatedEngine
from rolledger.workers.operator.local_run import LocalRun, RunOptions
from rolledger.workers.policy.policy_model import load_policy
from rolledger.workers.roles.rank import RankWorker

STEP_S = 0.045  # declared decode step
PREFILL_S_PER_TOKEN = 0.0002
STRAGGLER = (200,) * 7 + (4000,)


@dataclass
class Measured:
    name: str
    window_s: float
    trained: int
    steps: int
    trainer_idle: float
    rollout_idle: float
    lag_mean: float
    lag_max: int
    wasted: int
    generated: int
    dropped: int
    first_batch_s: float  # first GroupAdmitted to the first BatchConsumed: the trainer waits for a whole batch
    update_s: float  # mean UpdateStaged to PolicyPublished: the trainer's wait for each update it staged
    gen_bound_s: float = 0.0  # G of the module docstring
    train_bound_s: float = 0.0  # R of the module docstring

    @property
    def bound_s(self) -> float:
        return max(self.gen_bound_s, self.train_bound_s)

    @property
    def of_bound(self) -> float:
        return self.bound_s / self.window_s

    @property
    def per_s(self) -> float:
        return self.trained / self.window_s


GROUP = 8  # samples per group


def max_num_seqs(args: argparse.Namespace) -> int:
    """Sequences one rank's engine decodes at once: what --slots groups of 8 hold."""
    return args.slots * GROUP


def base_config(args: argparse.Namespace, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "seed": args.seed,
        "steps": args.steps,
        "engine": "simulated",
        "ranks": args.ranks,
        "rank_slots": args.slots,
        "group_size": GROUP,
        "sampling": {"max_tokens": 4000},
        "simulated": {
            "step_s": STEP_S,
            "prefill_s_per_token": PREFILL_S_PER_TOKEN,
            "time_scale": args.time_scale,
            "length_median": 200,
            "prompt_sigma": 0.6,
            "length_sigma": 0.8,
            "max_num_seqs": max_num_seqs(args),
        },
        "admission": {
            "max_lag": 0,
            "max_inflight_groups": args.ranks * args.slots,
            "max_queued_bytes": 256 * 1024 * 1024,
            "throttle_to_drain_rate": False,
        },
        "trainer": {"groups_per_step": 8, "warm_start_steps": 0},
        "task": {"num_prompts": 16},
    }
    for key, value in over.items():
        if isinstance(value, dict):
            cfg[key] = {**cfg.get(key, {}), **value}
        else:
            cfg[key] = value
    return cfg


# interruptible generation: in-flight samples park through each update and continue under the new version, and the
# trainer trains its next step beside the open update
INTERRUPTIBLE: dict[str, Any] = {
    "interruptible": True,
    "update": {"drain_mode": "keep"},
    "trainer": {"overlap_update": True},
}
# an update cuts the samples in flight short (drain "abort"), with the trainer overlapping it as above
ABORTING: dict[str, Any] = {"update": {"drain_mode": "abort"}, "trainer": {"overlap_update": True}}

CONFIGS: dict[str, dict[str, Any]] = {
    "synchronous": {"admission": {"max_lag": 0}},
    "one-step-off": {"admission": {"max_lag": 1}},
    "async": {"admission": {"max_lag": "CAP"}},
    "async+srgf+i": {**INTERRUPTIBLE, "admission": {"max_lag": "CAP"}, "scheduler": "srgf"},
    "async+t+i": {**INTERRUPTIBLE, "admission": {"max_lag": "CAP", "throttle_to_drain_rate": True}},
    "async+yc+i": {
        **INTERRUPTIBLE,
        "admission": {"max_lag": "CAP", "throttle_to_drain_rate": True},
        "scheduler": "youngest-cancel",
    },
    "async+srgf+kN+i": {
        **INTERRUPTIBLE,
        "admission": {"max_lag": "CAP"},
        "scheduler": "srgf",
        "partial_policy": {"kind": "first_k", "k": 6},
    },
    "async+srgf+i+s": {
        **INTERRUPTIBLE,
        "admission": {"max_lag": "CAP", "max_inflight_groups": "GROUPS_IN_SEQUENCES"},
        "scheduler": "srgf",
        "rank_capacity": "sequences",
        "rank_slots": "SLOTS_IN_SEQUENCES",
    },
    "async+srgf+a": {**ABORTING, "admission": {"max_lag": "CAP"}, "scheduler": "srgf"},
    "async+srgf+a+r": {**ABORTING, "admission": {"max_lag": "CAP"}, "scheduler": "srgf", "recycle_aborted": True},
}


def simulated_trainer(url: str, run_id: str, train_s: float, stop: threading.Event) -> None:
    """The SIMULATED trainer: each batch costs `train_s` of waiting and a tiny real weight change; agreement is not
    measured (the engine's own logprobs are handed back: see the module docstring)."""
    with TrainerClient.connect(url, run_id, name="simulated-trainer", timeout_s=120) as client:
        client.stop = stop
        client.follow()
        deadline = time.monotonic() + 120
        while len(client.follower.state.ranks) < client.config.ranks:  # the ranks load the policy first: transformers'
            if time.monotonic() > deadline:  # loading patches torch globally, so two threads must not load at once
                raise SystemExit(f"{run_id}: the ranks did not join")
            client.follow(block_ms=100)
        model, _ = load_policy(client.model_dir)
        overlap = client.config.trainer.overlap_update
        first = next(iter(model.parameters()))
        while (batch := client.next_batch(policy_weights(model))) is not None:
            client.agreement(batch, [list(t.logprobs) for t in batch.on_policy_trajectories])  # not measured
            started = time.perf_counter()
            with torch.no_grad():
                first.add_(1e-4)
            stop.wait(max(0.0, train_s - (time.perf_counter() - started)))  # the declared train time
            took_ms = (time.perf_counter() - started) * 1e3
            stats = SimpleNamespace(
                loss=0.0, reward_mean=statistics.fmean(batch.rewards), max_seq_ratio=1.0, clipped_frac=0.0
            )
            try:
                # beside an open update (overlap_update) publish returns once recorded: the next step trains now
                client.publish(batch, policy_weights(model), stats, train_ms=took_ms, wait=not overlap)
            except UpdateFailed as e:
                print(f"  {run_id}: step {batch.step}: {e}", flush=True)


def run_one(url: str, root: Path, run_id: str, cfg: RunConfig, train_s: float) -> tuple[list[ev.Event], list[Any]]:
    """One run with the simulated trainer; its events and its engines."""
    run = LocalRun(
        RunOptions(config=cfg, redis_url=url, run_id=run_id, runs_dir=root, external_trainer=True, handle_signals=False)
    )
    holder: dict[str, list[ev.Event]] = {}
    failed: list[BaseException] = []

    def drive() -> None:
        try:
            run.execute(keep_events=holder)
        except BaseException as e:  # noqa: BLE001 - reported on the main thread
            failed.append(e)

    stop = threading.Event()
    driver = threading.Thread(target=drive, name=f"{run_id}-driver", daemon=True)
    driver.start()
    try:
        simulated_trainer(url, run_id, train_s, stop)
    except BaseException:
        stop.set()
        run.signalled = signal.SIGTERM  # end the run as cancelled (what a SIGTERM of `rolledger run` does)
        run._signal_seen.set()
        raise
    finally:
        driver.join(timeout=cfg.run_deadline_s)
        stop.set()
    if failed:
        raise SystemExit(f"run {run_id} failed: {failed[0]!r}")
    engines = [w.engine for w in run.workers if isinstance(w, RankWorker)]
    return holder["events"], engines


def union_s(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def measure(
    name: str, events: list[ev.Event], engines: list[Any], args: argparse.Namespace, declared_train_s: float
) -> Measured:
    ranks = args.ranks
    admitted = [e.wall_time for e in events if isinstance(e.payload, ev.GroupAdmitted)]
    consumed = [e for e in events if isinstance(e.payload, ev.BatchConsumed)]
    lo, hi = min(admitted), max(e.wall_time for e in consumed)
    window = hi - lo
    train_s = sum(e.payload.train_ms for e in events if isinstance(e.payload, ev.TrainStepFinished)) / 1e3
    lags = [lag for e in consumed if isinstance(e.payload, ev.BatchConsumed) for lag in e.payload.lags]
    trained = sum(len(e.payload.trajectory_ids) for e in consumed if isinstance(e.payload, ev.BatchConsumed))
    start: dict[str, tuple[int, float]] = {}
    end: dict[str, float] = {}
    for e in events:
        p = e.payload
        if isinstance(p, ev.SampleStarted):
            start.setdefault(p.group_id, (p.rank, e.wall_time))
        elif isinstance(p, ev.SampleFinished | ev.SampleCancelled | ev.SampleFailed):
            gid = p.trajectory.group_id if isinstance(p, ev.SampleFinished) else p.group_id
            end[gid] = max(end.get(gid, 0.0), e.wall_time)
    staged = {e.payload.version: e.wall_time for e in events if isinstance(e.payload, ev.UpdateStaged)}
    opened = [
        e.wall_time - staged[e.payload.version]
        for e in events
        if isinstance(e.payload, ev.PolicyPublished) and e.payload.version in staged
    ]
    busy = [
        union_s([(t, end[g]) for g, (r, t) in start.items() if r == rank and g in end], lo, hi) / window
        for rank in range(ranks)
    ]
    sims = [e for e in engines if isinstance(e, SimulatedEngine)]
    return Measured(
        name=name,
        window_s=window,
        trained=trained,
        steps=len(consumed),
        trainer_idle=max(0.0, 1 - train_s / window),
        rollout_idle=1 - statistics.fmean(busy),
        lag_mean=statistics.fmean(lags) if lags else 0.0,
        lag_max=max(lags, default=0),
        wasted=sum(e.payload.tokens for e in events if isinstance(e.payload, ev.SampleCancelled)),
        generated=sum(e.stats.generated_tokens for e in sims),
        dropped=sum(1 for e in events if isinstance(e.payload, ev.TrajectoryDropped)),
        first_batch_s=min(e.wall_time for e in consumed) - lo,
        update_s=statistics.fmean(opened) if opened else 0.0,
        **bounds(events, consumed, args, declared_train_s),
    )


def bounds(
    events: list[ev.Event], consumed: list[ev.Event], args: argparse.Namespace, train_s: float
) -> dict[str, float]:
    """G and R of the module docstring, from the trained samples' lengths and the declared capacity and times."""
    step = STEP_S * args.time_scale
    rate = args.ranks * max_num_seqs(args) / step  # tokens per second, every engine full
    length = {
        e.payload.trajectory.trajectory_id: len(e.payload.trajectory.token_ids)
        for e in events
        if isinstance(e.payload, ev.SampleFinished)
    }
    batches = sorted((e.payload for e in consumed if isinstance(e.payload, ev.BatchConsumed)), key=lambda b: b.step)
    trained = [length[t] for b in batches for t in b.trajectory_ids]
    first = [length[t] for t in batches[0].trajectory_ids]
    gen = max(sum(trained) / rate, max(trained) * step)
    first_s = max(sum(first) / rate, max(first) * step)
    return {"gen_bound_s": gen, "train_bound_s": first_s + (len(batches) - 1) * train_s}


def straggler(url: str, root: Path, args: argparse.Namespace, policy: dict[str, Any], tag: str) -> dict[str, float]:
    """One group of 7 x 200 + 1 x 4,000 tokens under `policy`: when the seven ended, when the group ended."""
    cfg = RunConfig.model_validate(
        base_config(
            args,
            steps=1,
            ranks=1,
            rank_slots=1,
            partial_policy=policy,
            simulated={"lengths": list(STRAGGLER)},
            admission={"max_lag": 0, "max_inflight_groups": 1},
            trainer={"groups_per_step": 1},
        )
    )
    events, engines = run_one(url, root, f"straggler-{tag}", cfg, args.train_s * args.time_scale)
    g = "g000000"
    t0 = min(e.wall_time for e in events if isinstance(e.payload, ev.SampleStarted) and e.payload.group_id == g)
    short = sorted(
        e.wall_time
        for e in events
        if isinstance(e.payload, ev.SampleFinished)
        and e.payload.trajectory.group_id == g
        and len(e.payload.trajectory.token_ids) == 200
    )
    ended = [
        e.wall_time
        for e in events
        if (isinstance(e.payload, ev.SampleFinished) and e.payload.trajectory.group_id == g)
        or (isinstance(e.payload, ev.SampleCancelled) and e.payload.group_id == g)
    ]
    completed = next(
        e.wall_time for e in events if isinstance(e.payload, ev.GroupCompleted) and e.payload.group_id == g
    )
    return {
        "seven_done": short[-1] - t0,
        "completed": completed - t0,
        "group_end": max(ended) - t0,
        "wasted": float(sum(e.tokens_wasted for e in engines if isinstance(e, SimulatedEngine))),
    }


def resolved(over: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A configuration's overrides with its placeholders filled from the flags."""
    fill = {
        "CAP": args.lag_cap,
        "SLOTS_IN_SEQUENCES": args.slots * GROUP // 2,  # a group down to its last 2 sequences holds no more room
        "GROUPS_IN_SEQUENCES": args.ranks * args.slots * GROUP // 2,
    }

    def one(v: Any) -> Any:
        return fill.get(v, v) if isinstance(v, str) else v

    return {k: ({kk: one(vv) for kk, vv in v.items()} if isinstance(v, dict) else one(v)) for k, v in over.items()}


def table(results: list[Measured]) -> None:
    sync = results[0]
    print(
        f"\n{'configuration':<17}{'window s':>9}{'trained':>8}{'samples/s':>10}{'vs sync':>8}{'trainer idle':>13}"
        f"{'rollout idle':>13}{'lag mean':>9}{'lag max':>8}{'wasted tok':>11}{'of generated':>13}{'dropped':>8}"
        f"{'1st batch s':>12}{'update s':>9}{'bound s':>9}{'of bound':>9}"
    )
    for r in results:
        print(
            f"{r.name:<17}{r.window_s:>9.1f}{r.trained:>8}{r.per_s:>10.2f}{r.per_s / sync.per_s:>7.2f}x"
            f"{r.trainer_idle:>13.1%}{r.rollout_idle:>13.1%}{r.lag_mean:>9.2f}{r.lag_max:>8}{r.wasted:>11}"
            f"{r.wasted / max(1, r.generated):>13.1%}{r.dropped:>8}{r.first_batch_s:>12.2f}{r.update_s:>9.3f}"
            f"{r.bound_s:>9.2f}{r.of_bound:>9.2f}"
        )
    print(
        "bound s = max(G, R) (module docstring), per configuration from what it trained: "
        + ", ".join(
            f"{r.name} G {r.gen_bound_s:.2f} R {r.train_bound_s:.2f} "
            f"({'generation' if r.gen_bound_s >= r.train_bound_s else 'train'}-bound)"
            for r in results
        )
    )


def best_line(results: list[Measured], args: argparse.Namespace, train_s_flag: float) -> str:
    sync = results[0]
    best = max(results[1:], key=lambda r: r.per_s, default=sync)
    cap = args.lag_cap if best.name.startswith("async") else (1 if best.name == "one-step-off" else 0)
    return (
        f"best asynchronous: {best.name}, {best.per_s / sync.per_s:.2f}x synchronous throughput (aim > 2.77x), "
        f"{best.of_bound:.2f} of the bound (aim >= 0.95; --train-s {train_s_flag:g}, "
        f"{'generation' if best.gen_bound_s >= best.train_bound_s else 'train'}-bound); max lag {best.lag_max} "
        f"(cap {cap}: {'within' if best.lag_max <= cap else 'OVER'})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="trainer steps per configuration")
    ap.add_argument("--time-scale", type=float, default=0.05, help="multiplies every declared time")
    ap.add_argument(
        "--train-s",
        type=float,
        action="append",
        help="declared train time per step, before the scale: one workload each (repeatable; default 45 and 5)",
    )
    ap.add_argument("--lag-cap", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument(
        "--slots", type=int, default=4, help="rank_slots: groups a rank generates at once (its engine: slots x 8 seqs)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=[*CONFIGS, "straggler"], action="append", help="run only these (repeatable)")
    args = ap.parse_args()
    workloads: list[float] = args.train_s or [45.0, 5.0]
    if min(workloads) <= 0 or args.steps < 1 or args.time_scale <= 0 or args.ranks < 1 or args.slots < 1:
        print("bench_straggler: --train-s, --steps, --time-scale, --ranks and --slots must be > 0", file=sys.stderr)
        raise SystemExit(2)
    args.train_s = workloads[0]  # the straggler scenario's
    step = STEP_S * args.time_scale
    load_before = os.getloadavg()
    results: dict[float, list[Measured]] = {}
    strag: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp, redis_server() as (url, _):
        root = Path(tmp)
        for w, train_flag in enumerate(workloads):
            train_s = train_flag * args.time_scale
            for name, over in CONFIGS.items():
                if args.only and name not in args.only:
                    continue
                cfg = RunConfig.model_validate(base_config(args, **resolved(over, args)))
                print(f"running {name} (--train-s {train_flag:g}) ...", flush=True)
                run_id = f"bench-{name.replace('+', '-')}-w{w}"
                events, engines = run_one(url, root, run_id, cfg, train_s)
                results.setdefault(train_flag, []).append(measure(name, events, engines, args, train_s))
        if not args.only or "straggler" in args.only:
            print("running the straggler group (all 8, then first 7 of 8) ...", flush=True)
            strag["all-8"] = straggler(url, root, args, {"kind": "all"}, "all8")
            strag["first-7"] = straggler(url, root, args, {"kind": "first_k", "k": 7}, "first7")
    load_after = os.getloadavg()

    print(
        f"\nSIMULATED engine and trainer: decode step {STEP_S * 1e3:.0f} ms, prefill {PREFILL_S_PER_TOKEN * 1e3:.1f} ms"
        f"/token, all x time scale {args.time_scale:g} (step {step * 1e3:.2f} ms); lengths lognormal median 200 "
        f"sigma 1.0 cap 4000; groups of 8, 8 per step; {args.ranks} ranks x {args.slots} slots, each rank's engine "
        f"{max_num_seqs(args)} sequences at once ({args.ranks * max_num_seqs(args) / step:,.0f} tokens/s in all); "
        f"{args.steps} steps; lag cap {args.lag_cap}"
    )
    print("agreement not measured (simulated): the trainer echoes the engine's logprobs to the gate")
    for train_flag, rows in results.items():
        print(f"\nworkload --train-s {train_flag:g} (train {train_flag * args.time_scale:.2f} s/step scaled)")
        table(rows)
    if strag:
        a, f = strag["all-8"], strag["first-7"]
        bubble = a["group_end"] - f["group_end"]
        arithmetic = step * 3800
        print("\nstraggler group 7 x 200 + 1 x 4000 tokens (seconds from its first SampleStarted, scaled time)")
        print(f"{'':<10}{'seven logged':>13}{'completed':>10}{'group end':>10}{'wasted tok':>11}")
        for tag, m in strag.items():
            print(
                f"{tag:<10}{m['seven_done']:>13.3f}{m['completed']:>10.3f}{m['group_end']:>10.3f}{m['wasted']:>11.0f}"
            )
        print(
            "(all 8 required: the seven short samples end in the engine after 200 steps but are logged with the group, "
            "as the rollout streams samples only where a group may close early)"
        )
        print(
            f"first-7: the straggler was cut {f['group_end'] - f['seven_done']:.3f} s after the seventh finished "
            f"(the group's slot free again); bubble {bubble:.3f} s vs step x 3800 = {arithmetic:.3f} s "
            f"(ratio {bubble / arithmetic:.3f}; aim within 10%)"
        )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (2 shared CPUs)")
    for train_flag, rows in results.items():
        print(best_line(rows, args, train_flag))


if __name__ == "__main__":
    main()
