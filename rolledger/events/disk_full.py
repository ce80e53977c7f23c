"""A full disk, said once and plainly: `DiskFull` names the path a write could not finish, and what waits for room.

Every writer of a run's files (the trainer's staging, the archive's segments, the summary) turns ENOSPC and EDQUOT
into `DiskFull(path, what, need=...)`, one line naming the path and the device's error, never a traceback; what
the writer then does is its own, and always fail-closed: a version whose files could not be written is not
announced (workers.roles.trainer_client waits for room and stages it again), a segment that could not be written is not
recorded, so its entries stay in Redis untrimmed (the archiver tries again later), a summary that could not be
written says so. `free_bytes(path)` is the room on the filesystem holding `path` (or its nearest existing parent).
A library that reports the device's error as its own exception (safetensors: "... (os error 28)") is recognised too.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXT = ("os error 28", "os error 122", "No space left on device", "Disk quota exceeded")


class DiskFull(OSError):
    """A write of `path` failed because its filesystem is full (or over quota). `need`: the bytes the write wanted,
    when known (what waiting for room waits for)."""

    def __init__(self, path: str | Path, what: str, cause: BaseException, *, need: int = 0) -> None:
        code = getattr(cause, "errno", None)
        code = code if code in FULL_ERRNOS else errno.ENOSPC
        self.path = Path(path)
        self.what = what
        self.need = need
        self.detail = " ".join(str(getattr(cause, "strerror", None) or cause).split())
        super().__init__(code, f"{what}: no room to write {self.path} ({self.detail})", str(self.path))

    def __str__(self) -> str:
        return str(self.strerror)


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or seen.__context__


def is_disk_full(error: BaseException) -> bool:
    """Is `error` (or one it was raised from) a full filesystem or an exceeded quota?"""
    for e in _chain(error):
        if isinstance(e, DiskFull) or (isinstance(e, OSError) and e.errno in FULL_ERRNOS):
            return True
        if not isinstance(e, OSError) and any(t in str(e) for t in _FULL_TEXT):
            return True
    return False


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged write may still take on the filesystem holding `path` (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def has_room(path: str | Path, need: int) -> bool:
    """Is there room for `need` bytes (at least one block) on the filesystem holding `path`?"""
    return free_bytes(path) >= max(need, 4096)
