"""An in-process engine (torch, simulated) run in a process of its own: the engine core apart from the worker that
talks to the log, as vLLM v1 splits its engine core from its front end.

Why: the torch engine's decode loop is Python. In the rank worker's interpreter it shares one GIL with the worker's
control thread, rollout slots and heartbeats, so every millisecond those hold the GIL is added to a decode step
(bench/bench_rollout.py measures the two as equal). In its own process the engine has its own interpreter, and the
worker's control-plane work runs beside the decode, on another core, instead of inside it.

`EngineProcess(factory)` starts a child (multiprocessing, spawn) that builds the engine with `factory()` (a picklable
callable, e.g. functools.partial(TorchEngine, model, tokenizer, batch_groups=True)) and serves the Engine protocol
over one pipe. As with any spawned process, the parent's main script must guard its entry point
(`if __name__ == "__main__":`): the child imports it. Every message is pickled by value (standard pickle: tensors
travel as bytes, never as shared memory, so the child's weights are its own and a commit there cannot change the
parent's model).

- Calls: each runs on a thread of the child, so concurrent calls (the rollout slots' generate calls, a pause from the
  control thread) run concurrently in the engine as they would in-process. A call's exception is raised in the
  caller (an exception that cannot be pickled arrives as an EngineError naming its type and message).
- `generate`: `should_cancel` cannot cross a process boundary, so the caller's thread polls it every
  `cancel_poll_s` (10 ms) for the samples still running and sends the child the ones to cut; the child's engine
  polls its own set between decode steps. `on_sample` (engines that stream samples) is called on the caller's thread
  as each sample's message arrives.
- Properties (policy_version, is_paused, asleep_level, cache_generation, graph_generation, weights_digest): the
  engine's state changes only inside its own calls, so every reply carries the engine's state after the call, and
  the properties answer from the newest one (replies of concurrent calls are ordered by a sequence number taken as
  the child reads the state) without a round trip.
- The child's death (killed, crashed): every pending and later call raises EngineError naming the exit code, so the
  rank fails closed. The parent's death: the child reads end-of-file on the pipe and exits (a SIGKILLed rank leaves
  no engine behind).
"""

from __future__ import annotations

import copy
import itertools
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import structlog
import torch

from rolledger.schemas.config import SamplingParams
from rolledger.schemas.weights import WeightManifest
from rolledger.workers.engines.protocol import (
    CommitReport,
    Engine,
    EngineCapabilities,
    EngineError,
    EngineStats,
    GroupOutput,
    HealthReport,
    PauseMode,
    SampleOutput,
    SleepReport,
    TensorSpec,
    WakeReport,
    WakeTag,
)

CANCEL_POLL_S = 0.01
START_TIMEOUT_S = 300.0  # building the engine in the child: imports torch, loads the model
CLOSE_TIMEOUT_S = 30.0

READ_ATTRIBUTE = "read attribute"  # a call whose one argument names an attribute of the engine to read, not call

log = structlog.get_logger("engine_process")


@dataclass(frozen=True)
class EngineState:
    """What the properties answer: the engine's state after a call, read in the child."""

    seq: int
    policy_version: int
    weights_digest: str | BaseException  # what weights_digest() returns, or raises (asleep, nothing committed)
    is_paused: bool
    asleep_level: int
    cache_generation: int
    graph_generation: int


def _read_state(engine: Engine, seq: int) -> EngineState:
    digest: str | BaseException
    try:
        digest = engine.weights_digest()
    except EngineError as exc:
        digest = _portable(exc)
    return EngineState(
        seq=seq,
        policy_version=engine.policy_version,
        weights_digest=digest,
        is_paused=engine.is_paused,
        asleep_level=engine.asleep_level,
        cache_generation=engine.cache_generation,
        graph_generation=engine.graph_generation,
    )


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class _Carried:
    """Pickles an exception without calling its __init__ (whose arguments may differ from its `args`: StagingError's
    tensor, reason, kind); unpickled, it is the exception itself, attributes included."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self.exc), self.exc.args, dict(self.exc.__dict__))


def _portable(exc: BaseException) -> Any:
    """What to send for `exc`: itself, or carried without its __init__, or (when neither survives a pickle round
    trip) an EngineError saying what it was."""
    for candidate in (exc, _Carried(exc)):
        try:
            pickle.loads(pickle.dumps(candidate))
            return candidate
        except Exception:  # noqa: BLE001, S112 - try the next form; an unpicklable exception is replaced, never lost
            continue
    return EngineError(f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------------------------------- the child


class _Server:
    """The child's side: one engine, calls run on threads, replies sent under one lock."""

    def __init__(self, conn: Connection, engine: Engine) -> None:
        self.conn = conn
        self.engine = engine
        self.send_lock = threading.Lock()
        self.state_lock = threading.Lock()
        self.seq = itertools.count(1)
        self.cancelled: dict[int, set[int]] = {}
        self.pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="engine-call")

    def send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            self.conn.send_bytes(data)

    def state(self) -> EngineState:
        with self.state_lock:  # sequence numbers in the order the state was read
            return _read_state(self.engine, next(self.seq))

    def serve(self) -> None:
        while True:
            try:
                message = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):  # the parent is gone: nothing can use this engine any more
                os._exit(0)
            kind = message[0]
            if kind == "cancel":  # for a generate still running (one that ended has no set: nothing to cut)
                _, call_id, indices = message
                cut = self.cancelled.get(call_id)
                if cut is not None:
                    cut.update(indices)
            elif kind == "call":
                _, call_id, name, args, kwargs = message
                if name == "close":
                    self.run(call_id, name, args, kwargs)
                    self.send(("closed",))
                    os._exit(0)
                if name == "generate":  # before its thread runs: a cancel read next finds the set
                    self.cancelled[call_id] = set()
                self.pool.submit(self.run, call_id, name, args, kwargs)

    def run(self, call_id: int, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            if name == "generate":
                value: Any = self.generate(call_id, *args, **kwargs)
            elif name == READ_ATTRIBUTE:
                value = getattr(self.engine, args[0])  # a property (`stats`): read, not called
            else:
                value = getattr(self.engine, name)(*args, **kwargs)
            reply: tuple[Any, ...] = ("reply", call_id, True, value, self.state())
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            reply = ("reply", call_id, False, _portable(exc), self.state())
        finally:
            self.cancelled.pop(call_id, None)
        try:
            self.send(reply)
        except Exception as exc:  # noqa: BLE001 - a result that cannot be pickled: the caller must not wait forever
            self.send(
                ("reply", call_id, False, EngineError(f"{name}: its result cannot be sent back: {exc}"), reply[4])
            )

    def generate(
        self,
        call_id: int,
        prompt_token_ids: Sequence[int],
        n: int,
        sampling: SamplingParams,
        *,
        streams: bool,
        expect_version: int | None,
    ) -> GroupOutput:
        cut = self.cancelled[call_id]
        kwargs: dict[str, Any] = {"should_cancel": lambda i: i in cut, "expect_version": expect_version}
        if streams:
            kwargs["on_sample"] = lambda i, s: self.send(("sample", call_id, i, s))
        return self.engine.generate(prompt_token_ids, n, sampling, **kwargs)


def _serve(conn: Connection, factory: bytes, torch_threads: int) -> None:
    """The child's entry point: build the engine, say so, serve until the parent closes it or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides the end
    torch.set_num_threads(torch_threads)
    try:
        engine = pickle.loads(factory)()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send_bytes(pickle.dumps(("failed", _portable(exc))))
        return
    server = _Server(conn, engine)
    server.send(("ready", engine.capabilities, server.state()))
    server.serve()


# ---------------------------------------------------------------------------------------------------- the parent


class _Call:
    """One call waiting for its reply (and, for generate, its streamed samples)."""

    def __init__(self) -> None:
        self.messages: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()


class EngineProcess:
    """An Engine whose engine runs in a child process (see the module docstring)."""

    def __init__(
        self,
        factory: Callable[[], Engine],
        *,
        name: str = "engine",
        torch_threads: int | None = None,
        cancel_poll_s: float = CANCEL_POLL_S,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.name = name
        self.cancel_poll_s = cancel_poll_s
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        threads = torch_threads if torch_threads is not None else torch.get_num_threads()
        self._proc = ctx.Process(
            target=_serve, args=(child, pickle.dumps(factory), threads), name=f"{name}-core", daemon=True
        )
        self._proc.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self._proc.kill()
            raise EngineError(f"{name}: the engine process did not start within {start_timeout_s:.0f} s")
        try:
            first = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._proc.join(timeout=5)
            raise EngineError(f"{name}: the engine process exited while starting (exit code {self._proc.exitcode})")
        if first[0] == "failed":
            self._proc.join(timeout=5)
            raise first[1]
        _, self._capabilities, self._state = first
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # _calls, _state, _dead
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._dead: str | None = None
        self._closed = False
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ plumbing

    def _send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError) as exc:  # the pipe is closed: the child is gone
                raise EngineError(f"{self.name}: {self._gone()}") from exc

    def _gone(self) -> str:
        with self._lock:
            if self._dead is None:
                self._dead = f"the engine process exited (exit code {self._proc.exitcode})"
            return self._dead

    def _read(self) -> None:
        """The reader thread: route every message to the call it answers."""
        while True:
            try:
                message = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            if message[0] == "closed":
                break
            call_id = message[1]
            with self._lock:
                if message[0] == "reply":
                    state: EngineState = message[4]
                    if state.seq > self._state.seq:
                        self._state = state
                    call = self._calls.pop(call_id, None)
                else:
                    call = self._calls.get(call_id)
            if call is not None:
                call.messages.put(message)
        self._proc.join(timeout=CLOSE_TIMEOUT_S)
        reason = "the engine was closed" if self._closed else self._gone()
        with self._lock:
            self._dead = reason
            calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            call.messages.put(("dead",))

    def _start(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, _Call]:
        call = _Call()
        with self._lock:
            if self._dead is not None:
                raise EngineError(f"{self.name}: {self._dead}")
            call_id = next(self._ids)
            self._calls[call_id] = call
        self._send(("call", call_id, name, args, kwargs))
        return call_id, call

    def _result(self, message: tuple[Any, ...]) -> Any:
        if message[0] == "dead":
            raise EngineError(f"{self.name}: {self._dead}")
        _, _, ok, value, _ = message
        if not ok:
            raise value
        return value

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run `name(*args, **kwargs)` on the engine in the child; its result, or its exception raised here."""
        _, call = self._start(name, args, kwargs)
        return self._result(call.messages.get())

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    # ------------------------------------------------------------------ the Engine protocol

    @property
    def capabilities(self) -> EngineCapabilities:
        return self._capabilities

    @property
    def policy_version(self) -> int:
        return self._state.policy_version

    @property
    def is_paused(self) -> bool:
        return self._state.is_paused

    @property
    def asleep_level(self) -> int:
        return self._state.asleep_level

    @property
    def cache_generation(self) -> int:
        return self._state.cache_generation

    @property
    def graph_generation(self) -> int:
        return self._state.graph_generation

    def weights_digest(self) -> str:
        digest = self._state.weights_digest
        if isinstance(digest, BaseException):
            raise copy.copy(digest)  # one exception object per raise: each collects its own traceback
        return digest

    @property
    def stats(self) -> EngineStats:
        """A copy of the engine's counters, read now."""
        stats: EngineStats = self.call(READ_ATTRIBUTE, "stats")
        return stats

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
        kwargs = {"streams": on_sample is not None, "expect_version": expect_version}
        call_id, call = self._start("generate", (list(prompt_token_ids), n, sampling), kwargs)
        running = set(range(n))  # samples not ended nor cut yet: the ones should_cancel is asked about
        while True:
            try:
                message = call.messages.get(timeout=self.cancel_poll_s if should_cancel and running else None)
            except queue.Empty:
                message = None
            if message is not None and message[0] == "sample":
                _, _, i, sample = message
                running.discard(i)
                try:
                    assert on_sample is not None
                    on_sample(i, sample)
                except BaseException:
                    self._cut(call_id, range(n))  # the caller gives up on the group: free the engine's slots
                    raise
                continue
            if message is not None:
                return self._result(message)  # type: ignore[no-any-return]
            if should_cancel is not None:
                cut = [i for i in running if should_cancel(i)]
                if cut:
                    running.difference_update(cut)
                    self._cut(call_id, cut)

    def _cut(self, call_id: int, indices: Sequence[int] | range) -> None:
        try:
            self._send(("cancel", call_id, list(indices)))
        except EngineError:
            pass  # the child is gone: the call's reply says so

    def pause(self, mode: PauseMode) -> None:
        self.call("pause", mode)

    def resume(self) -> None:
        self.call("resume")

    def sleep(self, level: int) -> SleepReport:
        report: SleepReport = self.call("sleep", level)
        return report

    def wake(self, tags: Sequence[WakeTag]) -> WakeReport:
        report: WakeReport = self.call("wake", list(tags))
        return report

    def kv_cache_tokens(self) -> int | None:
        tokens: int | None = self.call("kv_cache_tokens")
        return tokens

    def live_tensor_specs(self) -> Mapping[str, TensorSpec]:
        specs: Mapping[str, TensorSpec] = self.call("live_tensor_specs")
        return specs

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> str:
        digest: str = self.call("stage_weights", version, dict(tensors))
        return digest

    def commit_weights(self, version: int) -> CommitReport:
        report: CommitReport = self.call("commit_weights", version)
        return report

    def prepare(self, version: int, uri: str, manifest: WeightManifest) -> str:
        digest: str = self.call("prepare", version, uri, manifest)
        return digest

    def discard_weights(self) -> None:
        self.call("discard_weights")

    def reset_prefix_cache(self) -> int:
        generation: int = self.call("reset_prefix_cache")
        return generation

    def health(self) -> HealthReport:
        report: HealthReport = self.call("health")
        return report

    def close(self) -> None:
        """Close the engine and end its process (killed if it does not end within CLOSE_TIMEOUT_S)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._send(("call", 0, "close", (), {}))
        except EngineError:
            pass
        self._proc.join(timeout=CLOSE_TIMEOUT_S)
        if self._proc.is_alive():
            log.warning("engine process did not end; killing it", engine=self.name, pid=self._proc.pid)
            self._proc.kill()
            self._proc.join(timeout=5)
        self._reader.join(timeout=5)
        self._conn.close()
