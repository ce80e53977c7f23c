"""`rolledger run`: the whole loop on one machine — Redis (embedded unless given), the policy, and every worker as a
thread of this process, all talking only through the run's log. The same workers run as separate processes with
`rolledger coordinator` / `rolledger worker KIND`.

Steps: start Redis; build the tokenizer and the tiny policy, warm-start it (supervised) and save it to
`runs/<run-id>/model`; append RunStarted; start the coordinator, one rank worker per rank (each with its own engine),
the reward worker and the trainer (each wrapped by its injected faults, workers/operator/faults.py); follow the log with a
live display until RunFinished; write summary.json.

Inputs are refused before anything starts (`RunRefused`, workers/policy/run_inputs.py): a run id outside `RUN_ID_PATTERN` (no path separators,
no `..`, no braces), a task whose prompts cannot be loaded or whose reward functions cannot be imported, a run id that already has a run (directory with a Redis URL, AOF or summary) or a log (unless `resume`: then the run's log is
reopened and fresh workers continue it from the log; a finished run just gets its summary again), a busy metrics
port; and, once the policy's tokenizer and size are known (before its warm start), a `sampling.max_tokens` that does
not fit the model's positions beside the longest prompt (`check_fits`). `runs/<id>/redis_url` holds the URL with its password redacted, mode 0600.

SIGTERM/SIGINT of the driver (when it runs in the main thread) cancel the run: the coordinator thread is stopped,
the driver appends the decision RunFinished (cancelled, reason "signal SIGTERM") through the coordinator's fenced path
(`finish_as_coordinator` with `decide_cancel`), the workers stop, the summary is written, and `signalled` tells the
CLI to exit 128 + the signal number. The summary is always written after every worker stopped, from the final log, so
its numbers are the log's.

The driver decides nothing about the run: the coordinator aborts it at its deadline (`config.run_deadline_s`, set
from `RunOptions.deadline_s` when given) and fails it when a worker is lost. A crashed worker is replaced by its
respawn; one nothing restarts is recorded as the fact `WorkerLost`, and the coordinator's decider ends the run. When
the coordinator itself cannot go on (lost, or the deadline long past without its decision), the driver takes the
coordinator lease and appends the decision through the same conditional path (`finish_as_coordinator`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import redis
import structlog
import torch
from transformers import PreTrainedTokenizerBase

from rolledger.events.archive import archive_dir, iter_run
from rolledger.events.archiver import Archiver
from rolledger.events.connection import connect
from rolledger.events.disk_full import DiskFull, is_disk_full
from rolledger.events.embedded import EmbeddedRedis
from rolledger.events.envelope import make_event
from rolledger.events.redact import redact
from rolledger.events.snapshots import take_snapshot
from rolledger.events.store import EventLog, RunClosed, read_dead_letters
from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.schemas.injection import Injection, check_injections
from rolledger.workers.engines.factory import build_engines
from rolledger.workers.operator.faults import (
    Injector,
    mortal_coordinator,
    mortal_scorer,
    slow_and_mortal_trainer,
    wrap_engine,
)
from rolledger.workers.operator.incident_log import IncidentLog
from rolledger.workers.operator.metrics import RunMetrics
from rolledger.workers.policy.grpo import warm_start
from rolledger.workers.policy.policy_model import build_model, build_tokenizer, load_policy, policy_state, save_policy
from rolledger.workers.policy.run_inputs import (
    RunRefused,
    check_port_free,
    check_redis_fsync,
    check_reuse,
    check_run_id,
    check_task,
)
from rolledger.workers.policy.task_plugins import load_prompts, prompt_token_ids
from rolledger.workers.policy.tasks import supervised_examples
from rolledger.workers.roles.coordinator import Coordinator, finish_as_coordinator
from rolledger.workers.roles.rank import RankWorker
from rolledger.workers.roles.reward import RewardWorker
from rolledger.workers.roles.trainer import TrainerWorker
from rolledger.workers.runtime import gc_policy
from rolledger.workers.runtime.runtime import Follower, Worker
from rolledger.workers.weights.staging_store import StagingStore
from rolledger.workers.weights.tensors import state_digest
from rolledger.workers.weights.transport import close_store, fix_transport_port, open_trainer_store
from rolledger.workflows.coordinator import decide_cancel
from rolledger.workflows.incidents import dead_letter_incident
from rolledger.workflows.scheduler import PromptItem
from rolledger.workflows.state import RunState
from rolledger.workflows.summary import Summary, summarize
from rolledger.workflows.trainer import versions_to_keep

log = structlog.get_logger("run")

DEADLINE_GRACE_S = 30.0  # how long past the run deadline the driver waits for the coordinator to end the run


@dataclass
class RunOptions:
    config: RunConfig
    redis_url: str | None = None
    redis_fsync: str = "no"  # the embedded server's appendfsync (no | always); refused with redis_url (RunRefused)
    run_id: str | None = None
    runs_dir: Path = Path("runs")
    injections: list[Injection] = field(default_factory=list)
    deadline_s: float | None = None  # the run's deadline (config.run_deadline_s) when given
    metrics_port: int | None = None
    external_workers: bool = False  # start the run and follow it; the coordinator and workers are other processes
    external_trainer: bool = False  # start everything but the trainer: a loop on rolledger.client connects to the run
    model_dir: Path | None = None  # a checkpoint directory, used as is (no warm start); default runs/<run-id>/model
    on_progress: Callable[[Follower], None] | None = None
    on_warm_start: Callable[[int, float], None] | None = None  # (step, loss) of the warm start; (0, nan) before it
    resume: bool = False  # continue the log of an existing run id instead of refusing it
    handle_signals: bool = True  # SIGTERM/SIGINT cancel the run (only where the driver runs in the main thread)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def prompt_items(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> list[PromptItem]:
    """The run's prompts from its task plug-in, tokenised (through the chat template when the tokenizer has one)."""
    return [
        PromptItem(i, p.prompt_id, prompt_token_ids(tokenizer, p.text), p.answer)
        for i, p in enumerate(load_prompts(cfg.task, cfg.seed))
    ]


def check_fits(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, max_positions: int, limit_name: str) -> None:
    """RunRefused (one line naming both fields) when the longest prompt plus `sampling.max_tokens` does not fit the
    model's positions: every group would fail at the engine and the run would spin without ever training."""
    if cfg.engine == "simulated":
        return  # it generates declared lengths, not through the model: its max_tokens may pass the model's size
    longest = max((len(p.token_ids) for p in prompt_items(cfg, tokenizer)), default=0)
    if longest + cfg.sampling.max_tokens > max_positions:
        raise RunRefused(
            f"sampling.max_tokens={cfg.sampling.max_tokens} with the longest prompt ({longest} tokens) does not fit "
            f"{limit_name}={max_positions}: lower sampling.max_tokens to at most {max_positions - longest}"
        )
    if cfg.task.env is not None and longest + cfg.task.max_episode_tokens > max_positions:
        raise RunRefused(
            f"task.max_episode_tokens={cfg.task.max_episode_tokens} with the longest prompt ({longest} tokens) does "
            f"not fit {limit_name}={max_positions}: lower task.max_episode_tokens to at most {max_positions - longest}"
        )


def prepare_policy(
    cfg: RunConfig, model_dir: Path, on_step: Callable[[int, float], None] | None = None
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """Build the tiny policy of `cfg.model`, warm-start it and save it to model_dir; when model_dir already holds a
    checkpoint (a saved policy, or a Hugging Face checkpoint of a supported architecture) load it as is."""
    if (model_dir / "config.json").is_file():
        loaded, tokenizer = load_policy(model_dir)
        limit = getattr(loaded.config, "max_position_embeddings", None)
        if limit is not None:
            check_fits(cfg, tokenizer, int(limit), f"{model_dir / 'config.json'}: max_position_embeddings")
        return loaded, tokenizer
    tokenizer = build_tokenizer()  # its fit with cfg.model was checked before the run created anything (LocalRun)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, len(tokenizer), cfg.seed)
    if cfg.trainer.warm_start_steps:
        if on_step is not None:
            on_step(0, math.nan)  # step 0: the display says what is coming before the first step's wait
        examples = supervised_examples(cfg.task, cfg.seed, 4096)
        warm_start(
            model,
            tokenizer,
            examples,
            cfg.trainer.warm_start_steps,
            cfg.trainer.warm_start_lr,
            cfg.seed,
            on_step=on_step,
        )
    save_policy(model_dir, model, tokenizer)
    return model, tokenizer


class LocalRun:
    """Owns the Redis connection and the worker threads of one run in this process."""

    def __init__(self, opts: RunOptions) -> None:
        check_injections(opts.injections, opts.config, in_process=not opts.external_workers)
        self.opts = opts
        self.cfg = opts.config
        if opts.deadline_s is not None:
            self.cfg = self.cfg.model_copy(update={"run_deadline_s": opts.deadline_s})
        self.injector = Injector(opts.injections)
        self.run_id = opts.run_id if opts.run_id is not None else new_run_id()
        check_run_id(self.run_id)
        check_redis_fsync(opts.redis_fsync, opts.redis_url or os.environ.get("REDIS_URL"))
        check_task(self.cfg)
        if opts.metrics_port is not None:
            check_port_free(opts.metrics_port)
        self.run_dir = check_reuse(self.run_id, opts.runs_dir, opts.resume)
        if not ((opts.model_dir or self.run_dir / "model") / "config.json").is_file():  # the tiny policy, to be built
            check_fits(
                self.cfg, build_tokenizer(), self.cfg.model.max_position_embeddings, "model.max_position_embeddings"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.embedded: EmbeddedRedis | None = None
        self.client: redis.Redis | None = None
        self.workers: list[Worker] = []
        self._staging: StagingStore | None = None  # the trainer's store, made with the workers
        self._close_engines: Callable[[], None] = lambda: None
        self.signalled: int | None = None  # the signal that cancelled the run, if one did
        self.summary_error: str | None = None  # why summary.json could not be written (a full disk), if it was not
        self._signal_seen = threading.Event()

    def connect(self) -> redis.Redis:
        url = self.opts.redis_url or os.environ.get("REDIS_URL")
        if url is None:
            self.embedded = EmbeddedRedis(self.run_dir, fsync=self.opts.redis_fsync)
            url = self.embedded.start()
        url_file = self.run_dir / "redis_url"
        url_file.unlink(missing_ok=True)
        fd = os.open(url_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(redact(url) + "\n")
        self.client = connect(url)
        if not self.opts.resume and EventLog(self.client, self.run_id).length() > 0:
            raise RunRefused(f"run {self.run_id!r} already has a log at {redact(url)}; pass --resume to continue it")
        return self.client

    def execute(self, keep_events: dict[str, list[ev.Event]] | None = None) -> Summary:
        """Run to the end; `keep_events`, if given, receives the run's events under "events" (benchmarks)."""
        restore = self._install_signal_handlers()
        try:
            client = self.connect()
            try:
                follower = self._execute(client)
                self._stop_workers()
                return self._summarize(client, follower, keep_events)
            finally:
                self._stop_workers()
                self._close_engines()
                if self._staging is not None:
                    close_store(self._staging)
                if self.embedded is not None:
                    self.embedded.stop()
        finally:
            restore()

    def _stop_workers(self) -> None:
        for w in self.workers:
            w.stop()
        for w in self.workers:
            w.join(timeout=30)

    def _install_signal_handlers(self) -> Callable[[], None]:
        """SIGTERM and SIGINT cancel the run (see the module docstring); returns what puts the old handlers back."""
        if not self.opts.handle_signals or threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum: int, frame: FrameType | None) -> None:
            if self.signalled is None:
                self.signalled = signum
            self._signal_seen.set()

        old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for sig, handler in old.items():
                signal.signal(sig, handler)

        return restore

    def _cancel(self, client: redis.Redis) -> None:
        """End the run as cancelled by the signal: stop the coordinator thread (it releases its lease), then append
        the decision under the coordinator lease through the fenced path."""
        assert self.signalled is not None
        name = signal.Signals(self.signalled).name
        log.warning("signal received: cancelling the run", signal=name)
        for w in self.workers:
            if isinstance(w, Coordinator):
                w.stop()
                w.join(timeout=30)
        reason = f"signal {name}"
        if not finish_as_coordinator(client, self.run_id, "run", lambda state, now: decide_cancel(state, reason)):
            raise RuntimeError(f"run {self.run_id}: could not record the cancellation under the coordinator lease")

    def _execute(self, client: redis.Redis) -> Follower:
        cfg = self.cfg
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        model_dir = (self.opts.model_dir or self.run_dir / "model").absolute()
        model, tokenizer = prepare_policy(cfg, model_dir, self.opts.on_warm_start)
        logbook = EventLog(client, self.run_id)
        if logbook.length() == 0:
            self.cfg = cfg = fix_transport_port(cfg)
            logbook.append(
                make_event(
                    ev.RunStarted(
                        config=cfg, initial_weights_digest=state_digest(policy_state(model)), model_dir=str(model_dir)
                    ),
                    run_id=self.run_id,
                    producer="run",
                    policy_version=0,
                )
            )
        if not self.opts.external_workers and not self._signal_seen.is_set():
            self._build_workers(client, model, tokenizer, model_dir)
        with gc_policy.serving():  # what is built now is frozen: the collector stops walking it (workers/gc_policy)
            for w in self.workers:
                self._with_faults(w).start()
            return self._follow(client, logbook)

    def _build_workers(
        self, client: redis.Redis, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, model_dir: Path
    ) -> None:
        cfg = self.cfg
        injector = self.injector
        staging = None if self.opts.external_trainer else open_trainer_store(cfg, self.run_dir / "staging")
        self._staging = staging
        self.workers.append(Coordinator(client, self.run_id, "coordinator", prompt_items(cfg, tokenizer)))
        initial = {k: v.clone() for k, v in policy_state(model).items()}
        engines, self._close_engines = build_engines(cfg, model_dir, tokenizer, self.run_dir)
        for r, engine in enumerate(engines):
            self.workers.append(
                RankWorker(
                    client,
                    self.run_id,
                    r,
                    wrap_engine(engine, r, injector),
                    initial_weights=lambda: dict(initial),
                    tokenizer=tokenizer,
                )
            )
        self.workers.append(RewardWorker(client, self.run_id, "reward", tokenizer))
        if staging is not None:
            self.workers.append(TrainerWorker(client, self.run_id, "trainer", model, staging))
        else:
            log.info("waiting for an external trainer", run=self.run_id, model_dir=str(model_dir))

    def _with_faults(self, w: Worker) -> Worker:
        """Wrap the part of `w` its pending injections target (a fired injection is gone: a respawn runs clean)."""
        if isinstance(w, TrainerWorker):
            w.train = slow_and_mortal_trainer(w.train, self.injector)
        elif isinstance(w, Coordinator):
            w.append_decisions = mortal_coordinator(w.append_decisions, self.injector)
        elif isinstance(w, RewardWorker):
            w.scorer = mortal_scorer(w.scorer, self.injector)
        return w

    def _follow(self, client: redis.Redis, logbook: EventLog) -> Follower:
        """Follow the log (progress, metrics, dead workers) until the run finishes, its deadline passes, or a signal
        cancels it."""
        follower = Follower(logbook)
        metrics = RunMetrics()
        if self.opts.metrics_port is not None:
            metrics.serve(self.opts.metrics_port)
        incidents = IncidentLog(client, self.run_id)  # each abort, quarantine, halt, refusal... as a warning line
        give_up = time.monotonic() + self.cfg.run_deadline_s + DEADLINE_GRACE_S
        archiver = self._archiver(client)
        unarchived = 0  # entries this loop saw since the archiver last looked: no Redis command until it matters
        while not follower.state.status.is_terminal:
            if self._signal_seen.is_set():
                self._cancel(client)
                incidents.events(s.event for s in follower.catch_up())
                break
            polled = follower.poll(block_ms=200)
            got = [s.event for s in polled]
            incidents.events(got)
            incidents.poll_dead_letters()
            metrics.observe(follower.state, got)
            unarchived += len({s.stream_id for s in polled})  # entries (an entry holds one append's events)
            if archiver is not None and unarchived >= archiver.archive_every:
                unarchived = 0
                self._archive(archiver)
            if self.opts.on_progress is not None:
                self.opts.on_progress(follower)
            self._restart_dead()
            if time.monotonic() > give_up:  # the coordinator did not end the run at its deadline: end it as one
                log.error("the coordinator did not end the run at its deadline; ending it under its lease")
                if not finish_as_coordinator(client, self.run_id, "run"):
                    raise RuntimeError(f"run {self.run_id}: could not end the run under the coordinator lease")
                give_up = float("inf")
        return follower

    def _archiver(self, client: redis.Redis) -> Archiver | None:
        """The run's archiver (config `log`), run by this driver between its polls: the one process of a run that
        has both the run directory and the whole run's lifetime, in-process and external-workers modes alike. A pass
        costs a few Redis commands plus one XRANGE per entry page it archives, and runs once per `archive_every`
        entries."""
        cfg = self.cfg.log
        if not cfg.archive:
            return None
        return Archiver(
            client, self.run_id, archive_dir(self.run_dir), keep_live=cfg.keep_live, archive_every=cfg.archive_every
        )

    def _summarize(
        self, client: redis.Redis, follower: Follower, keep_events: dict[str, list[ev.Event]] | None
    ) -> Summary:
        """Once every worker stopped: fold the rest of the log, snapshot it, and write summary.json from it."""
        follower.catch_up()
        take_snapshot(client, self.run_id, follower.state, follower.last_id)
        archiver = self._archiver(client)
        if archiver is not None:  # the finished run's Redis (and its AOF) keeps the window too
            self._archive(archiver)
        events = [s.event for s in iter_run(client, self.run_id, archive_dir(self.run_dir))]
        if keep_events is not None:
            keep_events["events"] = events
        dead = [
            dead_letter_incident(d.dead_letter_id, d.source, d.reason) for d in read_dead_letters(client, self.run_id)
        ]
        summary = summarize(follower.state, events, dead)
        self._collect_staging(follower.state)  # first: what it frees may be the room the summary needs
        self._write_summary(summary)
        return summary

    def _archive(self, archiver: Archiver) -> None:
        """One archiver pass; a full disk is one line: nothing was recorded or trimmed, the entries stay in Redis,
        and the next pass (after `archive_every` more entries, or at the end) tries again."""
        try:
            archiver.run_once()
        except DiskFull as e:
            log.error(f"{e}; the entries stay in Redis, untrimmed, until a later pass can write them")

    def _write_summary(self, summary: Summary) -> None:
        """summary.json, atomically (a temporary file renamed into place). A full disk is one line naming the path
        and leaves any earlier summary as it was (`summary_error`); `rolledger run --resume RUN_ID` writes it again
        from the log once there is room."""
        path = self.run_dir / "summary.json"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
            os.replace(tmp, path)
            self.summary_error = None
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if not is_disk_full(e):
                raise
            self.summary_error = str(DiskFull(path, "run summary", e))
            log.error(f"{self.summary_error}; `rolledger run --resume {self.run_id}` writes it once there is room")

    def _collect_staging(self, state: RunState) -> None:
        """Once every in-process worker stopped: delete the staged versions nothing can need again. Kept: the
        published version (what a rank of a resumed run rejoins on) and the last one staged (what a resumed trainer's
        weights are, `weights_version`); an update still in flight is the latter. External workers stage where
        they are, so their store is theirs to collect."""
        if self.opts.external_workers or not self.workers:
            return
        store = self._staging
        if store is None:
            return
        keep = versions_to_keep(state)
        deleted = store.gc(keep)
        if deleted:
            log.debug("staged versions collected", deleted=len(deleted), kept=sorted(keep))

    def _restart_dead(self) -> None:
        """A worker thread killed by an injection is replaced by a fresh one under a new name (a restarted process),
        which reclaims what the dead one left pending."""
        for i, w in enumerate(self.workers):
            if w.alive or w.error is None or w.stop_event.is_set():
                continue
            replacement = w.respawn()
            if replacement is not None:
                log.warning("replacing dead worker", worker=w.name, replacement=replacement.name)
                self.workers[i] = replacement
                self._with_faults(replacement).start()
            elif not w.stop_event.is_set():  # a crash nothing restarts: record the fact; the coordinator fails the run
                w.stop()
                assert self.client is not None
                with contextlib.suppress(RunClosed):  # the run already ended: the loss changes nothing
                    EventLog(self.client, self.run_id).append(
                        make_event(
                            ev.WorkerLost(worker=w.name, kind=w.kind, error=repr(w.error)),
                            run_id=self.run_id,
                            producer="run",
                            policy_version=0,
                        )
                    )
                if isinstance(w, Coordinator):  # nobody else decides: the driver ends the run as the coordinator
                    finish_as_coordinator(self.client, self.run_id, "run", ttl_ms=w.lease.ttl_ms)
