"""A task's environment on a rank (issue 40): the function at `task.env`, each step run in a process of its own.

`EnvPool(path, workers=, timeout_s=)` keeps up to `workers` processes (`python -m rolledger.workers.policy.envs`),
each importing the function once and then running one step at a time: the rank sends it an EnvHistory
(schemas/episode.py) and waits at most `timeout_s` for its answer. `call(history)` returns the EnvReply, or, for
a step that cannot be used, the reason in words (the rank fails that sample only, SampleFailed stage "env"):
- it raised: `raised ValueError: ...` (the process stays, for the next step);
- it hung: `timed out after 2 s` (the process is killed, so a step that never returns holds nothing: the next call
  starts another);
- it answered something that is not a reply: `returned a str, not an EnvReply`, or the field pydantic refused
  (`returned an invalid reply: done: Input should be a valid boolean`);
- its process died (`its process exited with code -9`), or could not import the function.

Processes, not threads: a hung or runaway step is killed with its process, where a thread could only be abandoned
(and would keep its CPU, and hold the interpreter's exit). The child reads its requests from a pipe of its own, not
stdin/stdout, so an environment's prints never reach the protocol. `import_env(field, path)` resolves the path in the
calling process, before a run starts, naming the config field (as reward functions are checked).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from pydantic import ValidationError

from rolledger.schemas.episode import EnvHistory, EnvReply
from rolledger.workers.policy.rewards import RewardRefused, import_reward

_START_TIMEOUT_S = 60.0  # a child that has not imported the environment by then is killed


class EnvRefused(ValueError):
    """An environment that cannot be used: one line naming the config field and what failed."""


def import_env(field: str, path: str) -> Callable[..., Any]:
    """The callable at `module:function`; EnvRefused naming `field` otherwise."""
    try:
        return import_reward(field, path)
    except RewardRefused as exc:
        raise EnvRefused(str(exc)) from None


class _Child:
    """One environment process and its two pipes."""

    def __init__(self, path: str) -> None:
        down_r, down_w = os.pipe()  # the rank -> the child
        up_r, up_w = os.pipe()  # the child -> the rank
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the modules the rank sees (tests/, ...)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rolledger.workers.policy.envs", path, str(down_r), str(up_w)],
                pass_fds=(down_r, up_w),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(down_r)
            os.close(up_w)
        self.down = Connection(down_w, readable=False)
        self.up = Connection(up_r, writable=False)
        self.ready = False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a SIGKILLed process is reaped at once
            pass
        for conn in (self.down, self.up):
            try:
                conn.close()
            except OSError:
                pass

    def died(self) -> str:
        code = self.proc.poll()
        return f"its process exited with code {code}" if code is not None else "its process closed its pipe"


class EnvPool:
    """Up to `workers` environment processes of one rank, started as steps need them (see the module docstring)."""

    def __init__(self, path: str, *, workers: int, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._idle: list[_Child] = []
        self._all: set[_Child] = set()
        self._slots = threading.BoundedSemaphore(workers)
        self._lock = threading.Lock()
        self._closed = False
        self.started = 0  # processes started (replacements of killed ones included)

    def call(self, history: EnvHistory) -> EnvReply | str:
        """The environment's reply to `history`, or why there is none (one phrase, e.g. `timed out after 2 s`)."""
        with self._slots:
            child = self._take()
            if isinstance(child, str):
                return child
            try:
                child.down.send(history.model_dump())
                if not child.up.poll(self.timeout_s):
                    self._discard(child)
                    return f"timed out after {self.timeout_s:g} s"
                kind, value = child.up.recv()
            except (EOFError, OSError):
                reason = child.died()
                self._discard(child)
                return reason
            with self._lock:
                self._idle.append(child)
        if kind != "reply":
            return str(value)
        try:
            return EnvReply.model_validate(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(the reply)"
            return f"returned an invalid reply: {where}: {first['msg']}"

    def _take(self) -> _Child | str:
        """An idle process, else a new one once it has imported the environment; or why none could start."""
        with self._lock:
            if self._closed:
                return "its pool is closed (the rank is stopping)"
            while self._idle:
                child = self._idle.pop()
                if child.proc.poll() is None:
                    return child
                self._all.discard(child)
                child.kill()
            child = _Child(self.path)
            self._all.add(child)
            self.started += 1
        try:
            ready = child.up.poll(_START_TIMEOUT_S)
            kind, value = child.up.recv() if ready else ("start", f"did not start within {_START_TIMEOUT_S:g} s")
        except (EOFError, OSError):
            kind, value = "start", child.died()
        if kind != "ready":
            self._discard(child)
            return str(value)
        return child

    def _discard(self, child: _Child) -> None:
        with self._lock:
            self._all.discard(child)
        child.kill()

    def close(self) -> None:
        """Kill every process (the rank is stopping); a call after this returns a reason."""
        with self._lock:
            self._closed = True
            children, self._all, self._idle = list(self._all), set(), []
        for child in children:
            child.kill()


# ---------------------------------------------------------------- the child process
def _serve(path: str, down: Connection, up: Connection) -> None:
    try:
        fn = import_env("task.env", path)
    except EnvRefused as exc:
        up.send(("refused", f"could not be imported: {exc}"))
        return
    up.send(("ready", None))
    while True:
        try:
            request = down.recv()
        except (EOFError, OSError):
            return  # the rank closed its end: it is done with this process
        try:
            out = fn(EnvHistory.model_validate(request))
        except Exception as exc:  # noqa: BLE001 - an environment may raise anything: its sample fails, not the rank
            detail = " ".join(str(exc).split())
            up.send(("raised", f"raised {type(exc).__name__}: {detail}" if detail else f"raised {type(exc).__name__}"))
            continue
        if isinstance(out, EnvReply):
            answer: tuple[str, Any] = ("reply", out.model_dump())
        elif isinstance(out, dict):
            answer = ("reply", out)
        else:
            answer = ("garbage", f"returned a {type(out).__name__}, not an EnvReply")
        try:
            up.send(answer)
        except Exception as exc:  # noqa: BLE001 - a reply that cannot be pickled (an object in its info)
            up.send(("garbage", f"returned a reply that cannot be sent: {type(exc).__name__}: {exc}"))


if __name__ == "__main__":
    _serve(sys.argv[1], Connection(int(sys.argv[2]), writable=False), Connection(int(sys.argv[3]), readable=False))
