"""A SampleFinished's trajectory encoded once: the bytes a rank's size measure makes of it are the bytes its log
entry carries.

A rank counts each trajectory's accounting size (schemas/wire.encoded_size: the positional encoding plus the field
names) before it appends the SampleFinished; `measure` does that and keeps the positional encoding, by identity (the
newest, up to ENCODED_KEPT records and ENCODED_KEPT_BYTES of their bytes), and `encoded_form` hands it to the codec
(events/codec.encode), which writes the trajectory from it instead of encoding it a second time. Records are frozen,
so the bytes stay the record's encoding. The pure `encoded_size` (the audit's, admission's) keeps nothing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from rolledger.schemas.wire import encoded_size_and_form


def measure(record: Any) -> int:
    """`encoded_size(record)`, its positional encoding kept for `encoded_form`."""
    size, data = encoded_size_and_form(record)
    _measured.keep(record, data)
    return size


def encoded_form(record: Any) -> bytes | None:
    """The positional encoding `measure` made of this very record, taken out of the cache; None when it was not
    measured or has left it."""
    return _measured.take(record)


ENCODED_KEPT = 1024  # records measured and not yet written (the rollout threads of every rank of a process) ...
ENCODED_KEPT_BYTES = 16 << 20  # ... and their bytes (what a measure nobody writes leaves behind)


class _Measured:
    """The records `measure` measured, by identity, with their encodings; the oldest leave first."""

    def __init__(self) -> None:
        self._kept: OrderedDict[int, tuple[Any, bytes]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def keep(self, record: Any, data: bytes) -> None:
        with self._lock:
            old = self._kept.pop(id(record), None)
            if old is not None:
                self._bytes -= len(old[1])
            self._kept[id(record)] = (record, data)  # the record kept alive with it: its id is not reused meanwhile
            self._bytes += len(data)
            while len(self._kept) > ENCODED_KEPT or self._bytes > ENCODED_KEPT_BYTES:
                _, (_, gone) = self._kept.popitem(last=False)
                self._bytes -= len(gone)

    def take(self, record: Any) -> bytes | None:
        with self._lock:
            found = self._kept.pop(id(record), None)
            if found is None:
                return None
            self._bytes -= len(found[1])
        return found[1] if found[0] is record else None

    def __contains__(self, record: Any) -> bool:
        found = self._kept.get(id(record))
        return found is not None and found[0] is record

    def __len__(self) -> int:
        return len(self._kept)


_measured = _Measured()
