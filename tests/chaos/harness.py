"""One chaos schedule, end to end: a tiny distributed run (the processes of tests/test_distributed.py) on its own
redis-server with AOF, a supervisor that restarts what dies, the schedule's faults fired at their triggers, and the
checks of `checks.py` over what is left.

The processes: `rolledger run --external-workers` (the driver), one or two `rolledger coordinator` (the standby takes
over through the lease), `rolledger worker rank --rank 0|1`, `worker reward`, `worker trainer`. Each is started with
PYTHONPATH=tests/chaos/hook, whose sitecustomize wraps `EventLog.append*` to write every acknowledged event id to
`acks/<proc>.<incarnation>.log` (ROLLEDGER_ACK_LOG) and arms the `inject:` faults (ROLLEDGER_CHAOS_ARM_DIR); see
hook/rolledger_chaos_hook.py. Production code is not touched.

The supervisor is systemd's `Restart=always` with `RestartSec`: a process the harness SIGKILLed is restarted after
the fault's delay; a process that exits by itself before the run ended (a crash: recorded, with its log's tail) is
restarted after 1 s, at most `CRASH_RESTARTS` times. Once `RunFinished` is in the log nothing is restarted, and every
process must exit by itself within `exit_deadline_s`.

A schedule with `net:` faults gives every process its own `FaultProxy` (tests/fault_proxy.py) in front of the run's
redis-server and that process's `--redis` points at it (a restarted process gets the same one), so a network fault
hits one process's path to Redis; the harness itself reads the log directly. Without `net:` faults there is no proxy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from rolledger.events.archive import scan_run
from rolledger.events.keys import log_key
from rolledger.events.store import entry_types
from rolledger.schemas import events as ev

from .checks import Ack, Ending, Verdict, judge, parse_ack_log
from .schedule import Fault, Schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: its conftest's RedisProcess
from conftest import RedisProcess
from fault_proxy import FaultProxy

from .schedule import NET_JITTER_S, NET_LATENCY_S

REPO = Path(__file__).resolve().parents[2]
HOOK_DIR = Path(__file__).resolve().parent / "hook"
CRASH_RESTARTS = 10  # StartLimitBurst: a process that keeps crashing stays down after this many restarts
CRASH_RESTART_S = 1.0  # RestartSec for a process that exited by itself
POLL_S = 0.05


def config_toml(s: Schedule, staging: Path, run_deadline_s: float) -> str:
    """The tiny run of a schedule. Deadlines are short so that a fault resolves (abort, quarantine, terminal) well
    inside the schedule; the run deadline is the coordinator's last word, the harness's hang deadline comes after."""
    recycle = s.rollout == "recycle"  # samples long enough for an update's abort drain to cut, continued after it
    keep = s.rollout == "interruptible"  # samples long enough for an update's keep drain to park, continued on it
    long = recycle or keep
    many = s.rollout == "many"  # several groups in flight per rank, each rank's torch engine in a process of its own
    return f"""
steps = {s.steps}
rank_slots = {3 if many else 1}
group_size = {s.group_size}
ranks = 2
seed = {s.seed % 1000}
run_deadline_s = {run_deadline_s}
join_deadline_s = {run_deadline_s}
recycle_aborted = {str(recycle).lower()}
interruptible = {str(keep).lower()}
[sampling]
max_tokens = {24 if long else 4}
[admission]
max_lag = {2 if long else 1}
[trainer]
warm_start_steps = 0
groups_per_step = {s.groups_per_step}
[task]
num_prompts = 32
[update]
prepare_deadline_s = 10.0
drain_deadline_s = 10.0
commit_deadline_s = 10.0
drain_mode = "{"abort" if recycle else "keep" if keep else "wait"}"
staging_dir = "{staging}"
transport = "{s.transport}"
[torch_engine]
process = {str(many).lower()}
max_batch_groups = {2 if many else 0}
"""


def prepare_model(model_dir: Path, warm_start_steps: int = 10) -> Path:
    """The policy every schedule of a session starts from (`--model-dir`), so no driver warms up."""
    if not (model_dir / "config.json").is_file():
        from rolledger.schemas.config import RunConfig, TrainerConfig
        from rolledger.workers.operator.local_run import prepare_policy

        prepare_policy(RunConfig(trainer=TrainerConfig(warm_start_steps=warm_start_steps)), model_dir)
    return model_dir


@dataclass
class Proc:
    name: str
    args: list[str]
    popen: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    restart_at: float | None = None
    killed_by_us: bool = False
    crashes: list[str] = field(default_factory=list)
    exit_codes: list[int] = field(default_factory=list)
    killed: set[int] = field(default_factory=set)  # incarnations the harness SIGKILLed (maybe before the hook loaded)

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class Result:
    schedule: Schedule
    verdict: Verdict
    faults_fired: list[str]
    faults_not_fired: list[str]
    crashes: list[str]
    acks: int
    events: int
    wall_s: float
    workdir: Path

    @property
    def ok(self) -> bool:
        return self.verdict.ok

    def to_dict(self) -> dict[str, Any]:
        v = self.verdict
        return {
            "schedule": json.loads(self.schedule.to_json()),
            "ending": str(v.ending),
            "reason": v.reason,
            "violations": v.violations,
            "lost": [a.__dict__ for a in v.lost],
            "faults_fired": self.faults_fired,
            "faults_not_fired": self.faults_not_fired,
            "crashes": [c.splitlines()[0] for c in self.crashes],
            "acks": self.acks,
            "events": self.events,
            "wall_s": round(self.wall_s, 1),
        }


class Harness:
    def __init__(
        self,
        schedule: Schedule,
        workdir: Path,
        model_dir: Path,
        *,
        run_deadline_s: float = 60.0,
        start_deadline_s: float = 60.0,
        exit_deadline_s: float = 30.0,
        deadline_is_violation: bool = True,
    ) -> None:
        self.s = schedule
        self.dir = workdir
        self.model_dir = model_dir
        self.run_deadline_s = run_deadline_s
        self.hang_deadline_s = run_deadline_s + 45.0  # the driver itself ends the run 30 s after the run deadline
        self.start_deadline_s = start_deadline_s
        self.exit_deadline_s = exit_deadline_s
        self.deadline_is_violation = deadline_is_violation
        self.run_id = f"chaos-{schedule.seed}"
        self.redis = RedisProcess(workdir / "redis")
        self.proxies: dict[str, FaultProxy] = {}  # per process, for schedules with net: faults
        self.procs: dict[str, Proc] = {}
        self.counts: Counter[str] = Counter()
        self.last_id = "-"
        self.finished = False
        self.fired: list[str] = []  # the signal and Redis faults applied, when
        self.armed: list[str] = []  # the inject specs armed (they count once their process fires them)
        self.freezes: list[tuple[str, float]] = []  # armed freezes: (rank process, seconds) until seen stopped
        self.pending = list(schedule.faults)
        self.timers: list[tuple[float, str, str]] = []  # (when, action, target): SIGCONT, redis restart
        self.t0 = 0.0  # when the workers were started
        self.joined_at: float | None = None  # when both ranks had joined: `at:` triggers count from here
        self._client: redis.Redis | None = None
        self._resume_flag = self._driver_resume_flag()

    # ------------------------------------------------------------ processes
    def _driver_resume_flag(self) -> list[str]:
        """`rolledger run` may refuse to reopen a run id unless told `--resume` (issue 11, item 5): a restarted
        driver passes it when the CLI has it."""
        from rolledger.workers.operator.cli_parser import build_parser

        for action in build_parser()._actions:
            if isinstance(action, argparse._SubParsersAction):
                run = action.choices["run"]
                return ["--resume"] if any("--resume" in a.option_strings for a in run._actions) else []
        return []

    def _spawn(self, p: Proc) -> None:
        p.incarnation += 1
        logs = self.dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(HOOK_DIR), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "ROLLEDGER_ACK_LOG": str(self.dir / "acks" / f"{p.name}.{p.incarnation}.log"),
            "ROLLEDGER_CHAOS_ARM_DIR": str(self.dir / "arm" / p.name),
        }
        args = list(p.args)
        if p.name == "driver" and p.incarnation > 1:
            args += self._resume_flag
        p.popen = subprocess.Popen(
            [sys.executable, "-m", "rolledger.workers.operator.cli", "--json-logs", *args],
            stdout=(logs / f"{p.name}.{p.incarnation}.log").open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.dir,
            start_new_session=True,  # a signal to the harness's group does not reach them; we signal each one
        )
        p.restart_at = None
        p.killed_by_us = False

    def redis_url_for(self, name: str) -> str:
        """The --redis of process `name`: its own fault proxy's address when the schedule has network faults."""
        if not self.s.has_net_faults:
            return self.redis.url
        if name not in self.proxies:
            self.proxies[name] = FaultProxy(self.redis.port).start()
        return self.proxies[name].url()

    def _stop_proxies(self) -> None:
        for proxy in self.proxies.values():
            proxy.stop()

    def _proc_args(self, name: str) -> list[str]:
        common = ["--redis", self.redis_url_for(name), "--run", self.run_id]
        if name.startswith("coordinator"):
            return ["coordinator", *common]
        if name.startswith("rank"):
            return ["worker", "rank", *common, "--rank", name[len("rank") :]]
        return ["worker", name, *common]

    def _log_tail(self, p: Proc, chars: int = 1500) -> str:
        path = self.dir / "logs" / f"{p.name}.{p.incarnation}.log"
        try:
            return path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # ------------------------------------------------------------ the log, read-only
    def client(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.Redis.from_url(self.redis.url, socket_timeout=2.0, socket_connect_timeout=1.0)
        return self._client

    def poll_log(self) -> None:
        """New entries' types (the `t` field, no decoding); RunFinished ends the run. Redis may be down: skip."""
        try:
            while True:
                lo = self.last_id if self.last_id == "-" else "(" + self.last_id
                page: Any = self.client().xrange(log_key(self.run_id), lo, "+", count=500)
                if not page:
                    return
                for _, fields in page:
                    for kind in entry_types(fields) or ["?"]:
                        self.counts[kind] += 1
                        if kind == "RunFinished":
                            self.finished = True
                self.last_id = page[-1][0].decode()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            self._client = None

    # ------------------------------------------------------------ faults
    def _due(self, now: float) -> list[Fault]:
        due = []
        for step in list(self.pending):
            t = step.trigger
            joined = self.joined_at  # `at:` counts from both ranks' joining, so process start-up is not in it
            at_due = t.at_s is not None and joined is not None and now - joined >= t.at_s
            if (t.event is not None and self.counts[t.event] >= t.k) or at_due:
                self.pending.remove(step)
                due.append(step.fault)
        return due

    def _apply(self, f: Fault, now: float) -> None:
        at = f"t+{now - self.t0:.1f}s"
        if f.kind in ("kill", "stop"):
            p = self.procs.get(f.proc)
            if p is None or not p.alive:
                return  # not running (already dead, or not in this schedule): nothing to do
            assert p.popen is not None
            if f.kind == "kill":
                p.killed_by_us = True
                p.killed.add(p.incarnation)
                p.popen.send_signal(signal.SIGKILL)
                p.popen.wait()
                p.exit_codes.append(-9)
                p.restart_at = now + f.seconds
            else:
                p.popen.send_signal(signal.SIGSTOP)
                self.timers.append((now + f.seconds, "cont", f.proc))
            self.fired.append(f"{at} {f.render()}")
        elif f.kind in ("redis-term", "redis-kill"):
            if self.redis.proc is None or self.redis.proc.poll() is not None:
                return
            self.redis.stop(kill=f.kind == "redis-kill")
            self._client = None
            self.timers.append((now + f.seconds, "redis-start", ""))
            self.fired.append(f"{at} {f.render()}")
        elif f.kind == "net":
            proxy = self.proxies.get(f.proc)
            if proxy is None:
                return  # not in this schedule
            if f.spec == "latency":
                proxy.set_latency(NET_LATENCY_S, NET_JITTER_S)
                self.timers.append((now + f.seconds, "net-clear", f.proc))
            elif f.spec == "reset":
                proxy.reset_all()
            elif f.spec == "stall":
                proxy.stall(f.seconds)
            else:
                proxy.partition(f.seconds)
            self.fired.append(f"{at} {f.render()}")
        elif f.kind in ("freeze", "slow"):
            folder = self.dir / "arm" / f.proc
            folder.mkdir(parents=True, exist_ok=True)
            n = len(list(folder.iterdir()))
            tmp = folder / f"{n:03d}.tmp"
            tmp.write_text("freeze\n" if f.kind == "freeze" else f"slow-generate={f.seconds:g}\n")
            tmp.rename(folder / f"{n:03d}.stall")
            if f.kind == "freeze":
                self.freezes.append((f.proc, f.seconds))
            else:
                self.armed.append(f"slow-generate={f.seconds:g}")
        elif f.kind == "inject":
            folder = self.dir / "arm" / f.proc
            folder.mkdir(parents=True, exist_ok=True)
            n = len(list(folder.iterdir()))
            tmp = folder / f"{n:03d}.tmp"
            tmp.write_text(f.spec + "\n")
            tmp.rename(folder / f"{n:03d}.spec")  # the hook picks it up at the process's next opportunity
            self.armed.append(f.spec)

    def _frozen(self, now: float) -> None:
        """A rank that froze itself (state T in /proc) is continued after its freeze's seconds."""
        for item in list(self.freezes):
            p = self.procs.get(item[0])
            if p is None or not p.alive:
                continue
            assert p.popen is not None
            try:
                state = Path(f"/proc/{p.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state == "T":
                self.freezes.remove(item)
                self.timers.append((now + item[1], "cont", item[0]))
                self.fired.append(f"t+{now - self.t0:.1f}s freeze:{item[0]}:{item[1]:g} (seen stopped)")

    def _timers(self, now: float, force: bool = False) -> None:
        for item in list(self.timers):
            when, action, target = item
            if when > now and not force:
                continue
            self.timers.remove(item)
            if action == "cont":
                p = self.procs[target]
                if p.alive:
                    assert p.popen is not None
                    p.popen.send_signal(signal.SIGCONT)
            elif action == "redis-start":
                self.redis.start()
            elif action == "net-clear":
                self.proxies[target].set_latency(0.0)

    def _supervise(self, now: float) -> None:
        for p in self.procs.values():
            if p.popen is None:
                continue
            if p.restart_at is not None:
                if now >= p.restart_at and not self.finished:
                    self._spawn(p)
                continue
            code = p.popen.poll()
            if code is None:
                continue
            self.poll_log()  # it may have exited because the run ended: look before restarting it
            if self.finished:
                continue
            p.exit_codes.append(code)
            if code == 0:  # Restart=on-failure: a clean exit is a process done with its part (the trainer after its
                p.popen = None  # last step); one that left too early shows as a stalled run, a violation
                continue
            p.crashes.append(f"{p.name}.{p.incarnation} exited {code} at t+{now - self.t0:.1f}s:\n{self._log_tail(p)}")
            if len(p.crashes) <= CRASH_RESTARTS:
                p.restart_at = now + CRASH_RESTART_S

    # ------------------------------------------------------------ what a subclass (soak.py) adds
    def config_text(self) -> str:
        """The run's config (run.toml)."""
        return config_toml(self.s, self.dir / "staging", self.run_deadline_s)

    def tick(self, now: float) -> None:
        """Called on every supervisor tick while the run goes (`now`: time.monotonic())."""

    # ------------------------------------------------------------ the run
    def run(self) -> Result:
        start = time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg = self.dir / "run.toml"
        cfg.write_text(self.config_text())
        self.redis.start()
        hung: list[str] = []
        try:
            driver = Proc(
                "driver",
                ["run", "--redis", self.redis_url_for("driver"), "--run-id", self.run_id, "--config", str(cfg), "--runs-dir",
                 str(self.dir / "runs"), "--external-workers", "--model-dir", str(self.model_dir)],
            )  # fmt: skip
            self.procs["driver"] = driver
            self._spawn(driver)
            deadline = time.monotonic() + self.start_deadline_s
            while self.counts["RunStarted"] == 0:
                self.poll_log()
                if driver.popen is not None and driver.popen.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"harness: the driver did not start the run:\n{self._log_tail(driver)}")
                time.sleep(POLL_S)  # polling the log for RunStarted, with a deadline
            for name in self.s.processes[1:]:
                self.procs[name] = Proc(name, self._proc_args(name))
                self._spawn(self.procs[name])
            self.t0 = time.monotonic()
            while not self.finished:
                now = time.monotonic()
                if now - self.t0 > self.hang_deadline_s:
                    break
                self.poll_log()
                if self.joined_at is None and self.counts["RankJoined"] >= 2:
                    self.joined_at = now
                for f in self._due(now):
                    self._apply(f, now)
                self._frozen(now)
                self._timers(now)
                self._supervise(now)
                self.tick(now)
                time.sleep(POLL_S)  # the supervisor's tick: polling processes and the log
            self._timers(time.monotonic(), force=True)  # SIGCONT whatever is stopped, bring Redis back
            for proxy in self.proxies.values():  # and every process's path to it
                proxy.heal()
                proxy.resume()
            for p in self.procs.values():  # and a rank that froze itself after the last look at /proc
                if p.alive:
                    assert p.popen is not None
                    p.popen.send_signal(signal.SIGCONT)
            if self.redis.proc is None or self.redis.proc.poll() is not None:
                self.redis.start()
            exit_by = time.monotonic() + self.exit_deadline_s
            for p in self.procs.values():
                if p.popen is None or not self.finished:  # a hung run: nothing to wait for
                    continue
                try:
                    p.popen.wait(timeout=max(0.1, exit_by - time.monotonic()))
                except subprocess.TimeoutExpired:
                    if self.finished:
                        hung.append(f"{p.name}.{p.incarnation}")
        except BaseException:
            self._kill_all()
            self._stop_proxies()
            self.redis.stop(kill=True)
            raise
        self._kill_all()  # the hung ones: nothing appends while the log is read
        self._stop_proxies()
        try:
            events, undecodable = self._read_log()
        finally:
            self.redis.stop()
        acks, missing = self._read_acks()
        verdict = judge(
            events,
            acks,
            hooks_missing=missing,
            hung=hung,
            undecodable=undecodable,
            deadline_is_violation=self.deadline_is_violation,
        )
        if not self.finished and verdict.ending is not Ending.NOT_ENDED:
            verdict.violations.append("harness: RunFinished appeared only after the hang deadline")
        fired_inject = Counter(
            p.read_text().strip()
            for p in (self.dir / "arm").glob("*/*.fired")
            if p.read_text().strip() != "freeze"  # counted when the harness saw it stopped
        )
        fired = self.fired + [f"inject {spec}" for spec in sorted(fired_inject.elements())]
        never = Counter(self.armed) - fired_inject
        not_fired = [s.render() for s in self.pending] + [f"armed, never fired: {a}" for a in sorted(never.elements())]
        not_fired += [f"armed, never froze: freeze:{proc}:{secs:g}" for proc, secs in self.freezes]
        crashes = [c for p in self.procs.values() for c in p.crashes]
        return Result(
            self.s, verdict, fired, not_fired, crashes, len(acks), len(events), time.monotonic() - start, self.dir
        )

    def _kill_all(self) -> None:
        for p in self.procs.values():
            if p.alive:
                assert p.popen is not None
                p.popen.send_signal(signal.SIGCONT)
                p.popen.kill()
                p.popen.wait()

    def _read_log(self) -> tuple[list[ev.Event], int]:
        """The whole log, archived segments (a long run's driver archives and trims) and the live stream, decoded
        without the store's reader (which dead-letters into the run's Redis). A missing or tampered segment counts
        as its entries undecodable (the checks cannot see them)."""
        client = redis.Redis.from_url(self.redis.url)
        try:
            scan = scan_run(client, self.run_id)
        finally:
            client.close()
        return [s.event for s in scan.entries], len(scan.undecodable) + len(scan.problems)

    def _read_acks(self) -> tuple[list[Ack], list[str]]:
        acks: list[Ack] = []
        missing: list[str] = []
        for p in self.procs.values():
            for inc in range(1, p.incarnation + 1):
                path = self.dir / "acks" / f"{p.name}.{inc}.log"
                text = path.read_text() if path.is_file() else ""
                header, got = parse_ack_log(text, f"{p.name}.{inc}")
                if not header and inc not in p.killed:  # a SIGKILL may land before the interpreter ran the hook
                    missing.append(f"{p.name}.{inc}")
                acks += got
        return acks, missing


def run_schedule(
    schedule: Schedule,
    workdir: Path,
    model_dir: Path,
    *,
    keep: bool = False,
    run_deadline_s: float = 60.0,
    deadline_is_violation: bool = True,
) -> Result:
    """Run one schedule in `workdir` (removed afterwards when it passed, unless `keep`)."""
    harness = Harness(
        schedule, workdir, model_dir, run_deadline_s=run_deadline_s, deadline_is_violation=deadline_is_violation
    )
    start = time.monotonic()
    try:
        result = harness.run()
    except (RuntimeError, OSError, redis.RedisError) as exc:  # the harness itself failed: never a silent pass
        harness._stop_proxies()
        harness.redis.stop(kill=True)
        verdict = Verdict(Ending.NOT_ENDED, violations=[f"harness: {type(exc).__name__}: {exc}"[:2000]])
        crashes = [c for p in harness.procs.values() for c in p.crashes]
        result = Result(schedule, verdict, harness.fired, [], crashes, 0, 0, time.monotonic() - start, workdir)
    (workdir / "result.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    if result.ok and not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return result
