"""The chaos harness's hook inside each process it starts (loaded by this folder's sitecustomize.py).

Two things, both wrappers, none inside production code:

* **Acknowledged ids** (ROLLEDGER_ACK_LOG=<file>): every public `EventLog.append*` method is wrapped; when one
  returns (the server acknowledged the write), each event id it appended is written to the file with its stream id,
  as one `os.write` on an O_APPEND descriptor, so a SIGKILL a moment later cannot lose the line (it is in the
  kernel). A method that returns None (`append_once` lost its claim) or raises appended nothing and records nothing.
  The first line is a header `# hook pid=<pid>` written at install: its absence means the hook did not load.
* **Armed injections** (ROLLEDGER_CHAOS_ARM_DIR=<dir>): the harness arms an `--inject` spec for this process at a
  point of the run by writing `<dir>/<n>.spec`; an `ArmedInjector` picks new specs up (renaming them `.taken`, so
  a restarted process cannot take one twice) and the process's rank engine / trainer step are wrapped with
  `rolledger.workers.operator.faults`, exactly as `LocalRun` wraps its threads. A spec that fires leaves `<n>.fired`.
  `<n>.stall` files arm the hook's own rank faults at the start of the next group: `slow-generate=S` (a live rank
  whose group takes S s longer) and `freeze` (the process SIGSTOPs itself mid-group; the harness SIGCONTs it).

The hook format (one line per acknowledged event): `<event_id> <stream_id or -> <event type> <method>`.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_ack_fd: int | None = None


def _record(line: str) -> None:
    if _ack_fd is not None:
        os.write(_ack_fd, line.encode())


def _events_of(arg: object) -> list[Any]:
    from rolledger.schemas.events import Event

    if isinstance(arg, Event):
        return [arg]
    if isinstance(arg, Sequence) and not isinstance(arg, str | bytes):
        return [e for e in arg if isinstance(e, Event)]
    return []


def _wrap_append(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        if result is None or not args:
            return result
        events = _events_of(args[0])
        sids: list[str]
        if isinstance(result, str | bytes):
            sids = [result.decode() if isinstance(result, bytes) else result]
        elif isinstance(result, list | tuple):
            sids = [s.decode() if isinstance(s, bytes) else str(s) for s in result]
        else:
            sids = []
        if len(sids) != len(events):
            sids = ["-"] * len(events)
        _record("".join(f"{e.event_id} {s} {e.type} {name}\n" for e, s in zip(events, sids, strict=True)))
        return result

    wrapper.__chaos_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def install_ack_log(path: str) -> None:
    global _ack_fd
    from rolledger.events.store import EventLog

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    _ack_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    wrapped = []
    for name in sorted(vars(EventLog)):
        method = vars(EventLog)[name]
        if name.startswith("append") and callable(method) and not getattr(method, "__chaos_wrapped__", False):
            setattr(EventLog, name, _wrap_append(name, method))
            wrapped.append(name)
    _record(f"# hook pid={os.getpid()} wrapped={','.join(wrapped)}\n")


# ---------------------------------------------------------------- armed injections
def install_armed_injections(arm_dir: str) -> None:
    from rolledger.schemas.injection import parse_injection
    from rolledger.workers.operator import faults, processes
    from rolledger.workers.operator.faults import FaultyEngine, Injector, slow_and_mortal_trainer

    folder = Path(arm_dir)
    folder.mkdir(parents=True, exist_ok=True)

    class ArmedInjector(Injector):
        """An Injector whose pending injections are the specs the harness armed so far."""

        def _refresh(self) -> None:
            for spec in sorted(folder.glob("*.spec")):
                taken = spec.with_suffix(".taken")
                try:
                    spec.rename(taken)
                except OSError:
                    continue
                inj = parse_injection(taken.read_text().strip())
                self._pending.append(inj)
                self._files[id(inj)] = taken

        def __init__(self) -> None:
            super().__init__()
            self._files: dict[int, Path] = {}

        def peek(self, kind: str, **match: object) -> Any:
            self._refresh()
            return super().peek(kind, **match)

        def take(self, kind: str, **match: object) -> Any:
            inj = super().take(kind, **match)
            if inj is not None:
                taken = self._files.pop(id(inj), None)
                if taken is not None:
                    taken.with_suffix(".fired").write_text(inj.spec + "\n")
            return inj

    injector = ArmedInjector()
    original_serve = processes._serve

    def stalls(engine: Any) -> None:
        """The hook's own two rank faults (not `--inject` kinds), at the start of the engine's next group:
        `slow-generate=S` sleeps S s in the rollout thread (a live but slow rank: its other threads go on) and
        `freeze` SIGSTOPs the whole process mid-group (the harness sees it stopped and SIGCONTs it later)."""
        generate = engine.generate

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            for spec in sorted(folder.glob("*.stall")):
                taken = spec.with_suffix(".stalltaken")
                try:
                    spec.rename(taken)
                except OSError:
                    continue
                what = taken.read_text().strip()
                taken.with_suffix(".fired").write_text(what + "\n")
                if what.startswith("slow-generate="):
                    time.sleep(float(what.split("=", 1)[1]))  # the injected fault itself: a slow engine
                elif what == "freeze":
                    os.kill(os.getpid(), signal.SIGSTOP)
            return generate(*args, **kwargs)

        engine.generate = wrapped

    def die(inj: Any, where: str) -> None:
        """The process kills of `--inject` (kill-trainer@copy, kill-rank=R@receive): a SIGKILL, nothing after it."""
        os.write(2, f"chaos hook: {inj.spec} fires ({where}): SIGKILL\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)

    def serve(worker: Any) -> int:
        from rolledger.workers.roles.rank import RankWorker
        from rolledger.workers.roles.trainer import TrainerWorker
        from rolledger.workers.weights import transport_dist_receive
        from rolledger.workers.weights.transport import DistStagingStore

        if isinstance(worker, RankWorker):
            worker.engine = FaultyEngine(worker.engine, worker.rank, injector)
            stalls(worker.engine)
            rank = worker.rank

            def received(tag: int) -> None:
                inj = injector.take("kill-rank", rank=rank)
                if inj is not None:
                    die(inj, f"bucket {tag} received")

            transport_dist_receive.on_bucket_received = received
        elif isinstance(worker, TrainerWorker):
            worker.train = slow_and_mortal_trainer(worker.train, injector)
            if isinstance(worker.staging, DistStagingStore):

                def copied(version: int) -> None:
                    inj = injector.take("kill-trainer")
                    if inj is not None:
                        die(inj, f"v{version}'s copy written, not yet recorded")

                worker.staging.on_copied = copied
        return original_serve(worker)

    processes._serve = serve
    _ = faults


def install() -> None:
    ack = os.environ.get("ROLLEDGER_ACK_LOG")
    if ack:
        install_ack_log(ack)
    arm = os.environ.get("ROLLEDGER_CHAOS_ARM_DIR")
    if arm:
        install_armed_injections(arm)
