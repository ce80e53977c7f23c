"""One fold for the ranks (and the reward worker) of a process (workers/runtime/runtime.py `shared_follower`), against the real redis-server: the
rank workers of one process and run share one folded state and its lock; threads folding it at once fold each event
exactly once; and a rank's report that stops its generation (EnginePaused) holds its starts until the shared state
holds that report, whichever thread folds it."""

from __future__ import annotations

import threading
import time

import redis
import torch
from logbuilder import LogBuilder

from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
from rolledger.schemas.config import RunConfig
from rolledger.workers.engines.torch_engine import TorchEngine
from rolledger.workers.policy.policy_model import build_model, build_tokenizer
from rolledger.workers.roles.rank import RankWorker
from rolledger.workers.roles.reward import RewardWorker
from rolledger.workers.runtime.runtime import shared_follower
from rolledger.workflows import rank as rd
from rolledger.workflows.reducer import replay
from rolledger.workflows.replay import position


def _engine(rank: int) -> TorchEngine:
    torch.manual_seed(0)
    tok = build_tokenizer()
    return TorchEngine(build_model(RunConfig().model, len(tok), 0), tok, rank=rank)


def _log_events(run_id: str, groups: int) -> list[ev.Event]:
    b = LogBuilder(run_id=run_id).start_run()
    for _ in range(groups):
        b.group()
    return b.build()


def test_the_ranks_of_one_process_share_one_fold_and_one_lock(redis_url: str, run_id: str) -> None:
    client, other = redis.Redis.from_url(redis_url), redis.Redis.from_url(redis_url)
    a, b = RankWorker(client, run_id, 0, _engine(0)), RankWorker(client, run_id, 1, _engine(1))
    assert a.follower is b.follower and a.lock is b.lock
    assert RewardWorker(client, run_id, "reward", build_tokenizer()).follower is a.follower  # and the reward worker
    assert RankWorker(other, run_id, 2, _engine(2)).follower is not a.follower  # another pool: another process
    assert RankWorker(client, run_id + "-b", 0, _engine(0)).follower is not a.follower  # another run
    client.close()
    other.close()


def test_a_batch_another_thread_folded_first_is_not_folded_again(redis_client: redis.Redis, run_id: str) -> None:
    events = _log_events(run_id, 2)
    log = EventLog(redis_client, run_id)
    log.append_many(events)
    f = shared_follower(log)
    last = log.last_id()
    assert last is not None
    fetched = f.tail.after("0-0", through=last)  # one thread fetched the whole log ...
    assert [s.event for s in f.catch_up()] == events  # ... and another folded it first
    assert f._fold(fetched) == []  # the first thread's fold finds nothing new
    assert f.state.events_applied == len(events) and f.state.anomalies == []
    assert f.state.digest() == replay(events).digest()


def test_a_batch_partly_folded_by_another_thread_folds_only_the_rest(redis_client: redis.Redis, run_id: str) -> None:
    events = _log_events(run_id, 2)
    half = len(events) // 2
    log = EventLog(redis_client, run_id)
    log.append_many(events[:half])  # two entries
    log.append_many(events[half:])
    last = log.last_id()
    assert last is not None
    f = shared_follower(log)
    fetched = f.tail.after("0-0", through=last)  # one thread fetched the whole log ...
    first = [s for s in fetched if s.stream_id == fetched[0].stream_id]
    assert [s.event for s in f._fold(first)] == events[:half]  # ... another fetched and folded the first entry
    assert [s.event for s in f._fold(fetched)] == events[half:]  # the first thread folds only the rest
    assert f.state.anomalies == [] and f.state.digest() == replay(events).digest()


def test_threads_folding_one_shared_state_while_the_log_grows_fold_each_event_once(
    redis_client: redis.Redis, run_id: str
) -> None:
    events = _log_events(run_id, 40)
    log = EventLog(redis_client, run_id)
    f = shared_follower(log)
    errors: list[BaseException] = []

    def fold_until_done() -> None:
        deadline = time.monotonic() + 30
        try:
            while f.state.events_applied < len(events) and time.monotonic() < deadline:
                f.catch_up(block_ms=20)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=fold_until_done) for _ in range(8)]
    for t in threads:
        t.start()
    for i in range(0, len(events), 7):  # the log grows in small appends while the threads fold
        log.append_many(events[i : i + 7])
    for t in threads:
        t.join(timeout=40)
    assert not errors
    assert f.state.anomalies == []  # no event folded twice (a duplicate is an anomaly)
    assert f.state.events_applied == len(events)
    assert f.state.digest() == replay(events).digest()


def test_a_drain_report_holds_the_ranks_starts_until_the_shared_state_holds_it(redis_url: str, run_id: str) -> None:
    client = redis.Redis.from_url(redis_url)
    log = EventLog(client, run_id)
    log.append_many(LogBuilder(run_id=run_id).start_run().build())
    worker = RankWorker(client, run_id, 0, _engine(0))
    worker.follower.catch_up()
    assert worker.starts_held_through is None
    assert worker.execute(rd.ReportDrained(1, "wait", cause="01CMDADMISSIONPAUSED00001"))
    paused = list(log.read())[-1]
    assert isinstance(paused.event.payload, ev.EnginePaused)
    assert worker.engine.is_paused
    # held through the report itself: not folded yet, so no slot may start a group (rollout.Rollout._admit)
    assert worker.starts_held_through == paused.stream_id
    assert position(worker.follower.last_id) < position(paused.stream_id)
    # any thread's fold of the shared state releases it (here another rank of the process folds)
    RankWorker(client, run_id, 1, _engine(1)).follower.catch_up()
    assert position(worker.follower.last_id) >= position(worker.starts_held_through)
    client.close()
