"""The msgpack codec of events: msgspec's typed encoder and decoders over the locked positional layout.

Wire format: a msgpack array `[type, schema version, envelope, payload]`; the envelope and the payload (and the
records nested in it) are arrays of their field values in declaration order, named by the layouts locked for each
(type, version) in schemas/wire_layouts.json (schemas/wire_layout.py). Token ids, masks, positions and logprobs
travel as msgpack ExtType blobs of their raw little-endian bytes (schemas.base.ARRAY_EXT). The records are
msgspec Structs (schemas/events.py), so an entry is encoded in one C call and decoded in two (the frame, with the
payload left as raw bytes, then the payload with its type's own decoder): every field's type and bounds are checked
by that decode, so there is one path for every entry, trusted writer or not.

Older entries still decode, through the slower general path: logs written before the positional layout (the
self-describing map `{"t": type, "v": version, "e": envelope, "p": payload}`) and payloads of an older schema
version (named by their own locked layout, then upcast, schemas/events.UPCASTERS) are unpacked, named, upcast and
converted to the current record, validated as strictly. Every failure is a DecodeError with a reason fit for a
dead-letter entry, naming the field.

Once per process, twice never: a work consumer and the log's tail of one process read the same bytes of an event its
work group acts on; `SharedDecodes` (the process's `SHARED`, `decode_shared`) decodes them once for both. A
SampleFinished is encoded once: its trajectory's bytes are those events/measured.measure made to count its size.
"""

from __future__ import annotations

import functools
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable
from enum import StrEnum
from typing import Annotated, Any

import msgpack
import msgspec

from rolledger.events.measured import encoded_form
from rolledger.schemas.base import ARRAY_EXT, PACKED_TYPES, Record
from rolledger.schemas.events import PAYLOAD_TYPES, AppendMark, Event, Payload, SampleFinished, current_version, upcast
from rolledger.schemas.wire import dec_hook, enc_hook, ext_hook
from rolledger.schemas.wire_layout import (
    ENVELOPE_FIELDS,
    ENVELOPE_LENGTHS,
    LayoutMismatch,
    Namer,
    _model_of,
    check_locked,
    load_locked,
    namer,
)

if sys.byteorder != "little":  # pragma: no cover - every platform we run on is little-endian
    raise ImportError("the rolledger codec assumes a little-endian host")

_LOCKED = load_locked()
check_locked(_LOCKED)  # a payload changed without a new schema version fails every import, so every test, here
_NAMERS: dict[tuple[str, int], Namer] = {
    (name, int(version)): namer(layout)
    for name, by_version in _LOCKED.items()
    for version, layout in by_version.items()
}


class Trust(StrEnum):
    """How far `decode` trusts the bytes it is given. Since events became msgspec records both decode the same way,
    every field checked (msgspec validates as it builds, faster than any unchecked build was); kept so callers can
    still say which kind of input they hold."""

    VALIDATE = "validate"  # any bytes: foreign logs, audits, dead-letter checks
    OWN_LOG = "own-log"  # entries this project encoded into a log it trusts


class DecodeError(ValueError):
    """An entry that cannot become an Event; `reason` says why (garbage, unknown type, newer schema, invalid field)."""

    def __init__(self, reason: str, event_type: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.event_type = event_type


class _Envelope(Record, frozen=True, kw_only=True):
    event_id: str
    run_id: str
    producer: str
    causation_id: str | None
    correlation_id: str | None
    policy_version: Annotated[int, msgspec.Meta(ge=0)]
    wall_time: float
    append: AppendMark | None = None  # envelope v2 (issue 41); a v1 envelope (7 fields) decodes with None


if _Envelope.__struct_fields__ != ENVELOPE_FIELDS:  # pragma: no cover - a changed envelope fails every import
    raise RuntimeError(f"the codec's envelope {_Envelope.__struct_fields__} is not the wire's {ENVELOPE_FIELDS}")

_ENVELOPE_LENGTHS_TEXT = " or ".join(str(n) for n in ENVELOPE_LENGTHS)
_encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)
_frame = msgspec.msgpack.Decoder(tuple[str, int, _Envelope, msgspec.Raw])
_DECODERS: dict[str, tuple[int, msgspec.msgpack.Decoder[Any]]] = {
    name: (cls.SCHEMA_VERSION, msgspec.msgpack.Decoder(cls, ext_hook=ext_hook, dec_hook=dec_hook))
    for name, cls in PAYLOAD_TYPES.items()
}


def encode(event: Event, mark: AppendMark | None = None) -> bytes:
    """Event -> msgpack bytes: `[type, version, envelope, payload]`, the last two positional (arrays packed). The
    version written is the one whose layout the payload is written in: its record's SCHEMA_VERSION.

    The envelope's `append` is `mark`, the writer's (EventLog stamps the first event of each append): the mark an
    event read from a log holds says where that copy came from and is not carried into a new one.

    A SampleFinished whose trajectory was measured (events/measured.measure, as a rank does for its `nbytes`) is
    written with the trajectory's bytes from that measure: one encode of the trajectory, not two."""
    p = event.payload
    body: Any = _with_measured_trajectory(p) if type(p) is SampleFinished else p
    return _encoder.encode(
        (
            p.type,
            p.SCHEMA_VERSION,
            (
                event.event_id,
                event.run_id,
                event.producer,
                event.causation_id,
                event.correlation_id,
                event.policy_version,
                event.wall_time,
                mark,
            ),
            body,
        )
    )


_SAMPLE_FINISHED_FIELDS = SampleFinished.__struct_fields__


def _with_measured_trajectory(p: SampleFinished) -> Any:
    """The payload's positional form (what msgspec writes for the record: an array of its fields) with the
    trajectory as the bytes `measure` made of it; the payload itself when it was not measured."""
    data = encoded_form(p.trajectory)
    if data is None:
        return p
    raw = msgspec.Raw(data)
    return tuple(raw if name == "trajectory" else getattr(p, name) for name in _SAMPLE_FINISHED_FIELDS)


def decode(data: bytes, trust: Trust = Trust.VALIDATE) -> Event:
    """msgpack bytes -> Event, every field validated, an older payload version upcast. Raises DecodeError."""
    try:
        type_, version, env, raw = _frame.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return _decode_general(data)
    found = _DECODERS.get(type_)
    if found is None or found[0] != version:
        return _decode_general(data)
    try:
        payload = found[1].decode(raw)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"invalid {type_}: {_named(PAYLOAD_TYPES[type_], str(exc))}", type_) from None
    except msgspec.DecodeError as exc:
        raise DecodeError(f"invalid {type_}: {exc}", type_) from None
    return Event(
        event_id=env.event_id,
        schema_version=version,
        run_id=env.run_id,
        producer=env.producer,
        causation_id=env.causation_id,
        correlation_id=env.correlation_id,
        policy_version=env.policy_version,
        wall_time=env.wall_time,
        payload=payload,
        append=env.append,
    )


# ---------------------------------------------------------------- one decode per process
class SharedDecodes:
    """The events of a few types decoded once in this process for every reader that is handed the same bytes.

    A work consumer and the process's tail of the log read one event twice: the reward worker gets each
    SampleFinished from its work stream and again from the log, a rank each GroupAdmitted (events/work.py: the work
    entry holds the same codec bytes as the log's). A consumer of a work group asks for its types (`share`); then
    `decode` keeps what it decodes of them until a second reader takes it (or it is pushed out: the newest `kept`
    events, at most `kept_bytes` of their bytes). Keyed by the bytes themselves, so an event is only ever the decode
    of exactly those bytes: decoding is a pure function of them, and events are frozen. Entries of other types, or of
    the map form of older logs, are decoded as before, for the cost of one prefix check."""

    def __init__(self, kept: int = 4096, kept_bytes: int = 32 << 20) -> None:
        self.kept = kept
        self.kept_bytes = kept_bytes
        self.prefixes: tuple[bytes, ...] = ()  # how the entries of the shared types begin (`[type, ...`)
        self.hits = 0  # decodes saved (tests and benchmarks count them)
        self._events: OrderedDict[bytes, Event] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def share(self, types: Iterable[str]) -> None:
        """Decode the events of `types` once for this process's readers from now on."""
        with self._lock:
            self.prefixes = tuple(sorted({*self.prefixes, *(b"\x94" + _encoder.encode(t) for t in types)}))

    def decode(self, data: bytes, trust: Trust = Trust.VALIDATE) -> Event:
        """`decode(data, trust)`, once per process for the shared types."""
        if not self.prefixes or not data.startswith(self.prefixes):
            return decode(data, trust)
        with self._lock:
            found = self._events.pop(data, None)
            if found is not None:
                self._bytes -= len(data)
                self.hits += 1
                return found
        event = decode(data, trust)  # outside the lock: a DecodeError is the caller's, as for `decode`
        with self._lock:
            if data not in self._events:
                self._events[data] = event
                self._bytes += len(data)
                while len(self._events) > self.kept or self._bytes > self.kept_bytes:
                    gone, _ = self._events.popitem(last=False)
                    self._bytes -= len(gone)
        return event

    def __len__(self) -> int:
        return len(self._events)


SHARED = SharedDecodes()  # this process's
decode_shared = SHARED.decode


def named_form(data: bytes) -> dict[str, Any]:
    """An entry as the self-describing map `{"t": type, "v": version, "e": envelope, "p": payload}`, its positional
    parts named by their locked layouts (for a person reading raw entries, and for tests that reshape them; packing
    the map gives an entry `decode` reads as well). Raises DecodeError where the entry has no such form."""
    raw = msgpack.unpackb(data, raw=False, strict_map_key=False)  # arrays stay ext blobs: the map packs back as it was
    if type(raw) is not list:
        return dict(raw)
    if len(raw) != 4 or type(raw[2]) is not list:
        raise DecodeError("not an event envelope")
    name = _NAMERS.get((raw[0], raw[1]))
    if name is None:
        raise DecodeError(f"{raw[0]} v{raw[1]} has no locked wire layout")
    try:
        if len(raw[2]) not in ENVELOPE_LENGTHS:
            raise LayoutMismatch(f"envelope has {len(raw[2])} fields, not {_ENVELOPE_LENGTHS_TEXT}")
        env = dict(zip(ENVELOPE_FIELDS, raw[2]))
        mark = env.get("append")
        if type(mark) is list and len(mark) == len(AppendMark.__struct_fields__):
            env["append"] = dict(zip(AppendMark.__struct_fields__, mark))
        return {"t": raw[0], "v": raw[1], "e": env, "p": name(raw[3])}
    except (LayoutMismatch, ValueError) as exc:
        raise DecodeError(f"invalid {raw[0]}: {exc}") from None


# ---------------------------------------------------------------- the general path: older entries, and errors
def _msgpack_ext_hook(code: int, data: bytes) -> Any:
    if code != ARRAY_EXT:
        return msgpack.ExtType(code, data)
    try:
        return ext_hook(code, memoryview(data))
    except msgspec.ValidationError as exc:
        raise DecodeError(str(exc)) from None


def _decode_general(data: bytes) -> Event:
    """Any entry the typed path did not take: the map form, an older payload version, or a malformed entry (then
    the DecodeError says what is wrong with it)."""
    try:
        raw = msgpack.unpackb(data, ext_hook=_msgpack_ext_hook, raw=False, strict_map_key=False)
    except DecodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types for garbage
        raise DecodeError(f"not msgpack: {exc.__class__.__name__}: {exc}") from None
    if type(raw) is list:
        type_, version, env, fields = _named_positional(raw)
    else:
        try:
            type_, version, env, fields = raw["t"], raw["v"], raw["e"], raw["p"]
        except (KeyError, TypeError, IndexError):
            raise DecodeError("not an event envelope (expected [type, version, envelope, payload])") from None
        if type(type_) is not str or type(version) is not int:
            raise DecodeError("envelope type/version malformed")
        if type(env) is not dict or type(fields) is not dict:
            raise DecodeError(f"envelope fields and payload of {type_!r} must be maps", type_)
    try:
        fields = upcast(type_, version, fields)
    except ValueError as exc:  # an unknown type, a newer version (SchemaTooNew), a missing upcaster
        raise DecodeError(str(exc), type_) from None
    cls = PAYLOAD_TYPES[type_]
    env = dict(env)
    env.pop("schema_version", None)
    try:
        envelope = msgspec.convert(_in_order(_Envelope, env), _Envelope)
    except (msgspec.ValidationError, _Unexpected) as exc:
        raise DecodeError(f"invalid {type_}: {_named(_Envelope, str(exc))}", type_) from None
    try:
        payload = msgspec.convert(_in_order(cls, fields), cls, dec_hook=dec_hook)
    except (msgspec.ValidationError, _Unexpected) as exc:
        raise DecodeError(f"invalid {type_}: {_named(cls, str(exc))}", type_) from None
    return Event(
        event_id=envelope.event_id,
        schema_version=cls.SCHEMA_VERSION,
        run_id=envelope.run_id,
        producer=envelope.producer,
        causation_id=envelope.causation_id,
        correlation_id=envelope.correlation_id,
        policy_version=envelope.policy_version,
        wall_time=envelope.wall_time,
        payload=payload,
        append=envelope.append,
    )


def _named_positional(raw: list[Any]) -> tuple[str, int, dict[str, Any], dict[str, Any]]:
    """`[type, version, envelope, payload]` named by the locked layout of (type, version)."""
    if len(raw) != 4:
        raise DecodeError(f"not an event envelope (expected [type, version, envelope, payload], got {len(raw)} items)")
    type_, version, env, payload = raw
    if type(type_) is not str or type(version) is not int:
        raise DecodeError("envelope type/version malformed")
    if type(env) is not list or type(payload) is not list:
        raise DecodeError(f"envelope and payload of {type_!r} must be arrays", type_)
    if len(env) not in ENVELOPE_LENGTHS:
        raise DecodeError(f"invalid {type_}: envelope has {len(env)} fields, not {_ENVELOPE_LENGTHS_TEXT}", type_)
    name = _NAMERS.get((type_, version))
    if name is None:
        try:
            current_version(type_, version)  # an unknown type or a newer version: its own message
        except ValueError as exc:
            raise DecodeError(str(exc), type_) from None
        raise DecodeError(f"{type_} v{version} has no locked wire layout", type_)
    try:
        fields = name(payload)
    except LayoutMismatch as exc:
        raise DecodeError(f"invalid {type_}: payload has {exc}", type_) from None
    return type_, version, dict(zip(ENVELOPE_FIELDS, env)), fields


class _Unexpected(ValueError):
    """A named form with a field its record does not have, or without one it needs."""


_MISSING = object()


@functools.cache
def _plan(cls: type[Record]) -> tuple[frozenset[str], tuple[tuple[str, Any, Any, type[Record] | None, bool], ...]]:
    """(field names, (name, default, default factory, nested record, a sequence of them?) per field) of a record,
    computed once per class: msgspec.structs.fields evaluates every annotation each time it is called."""
    plan = []
    for f in msgspec.structs.fields(cls):
        default = _MISSING if f.default is msgspec.NODEFAULT else f.default
        factory = None if f.default_factory is msgspec.NODEFAULT else f.default_factory
        inner, seq = _nested_record(f.type)
        plan.append((f.name, default, factory, inner, seq))
    return frozenset(p[0] for p in plan), tuple(plan)


def _in_order(cls: type[Record], fields: Any) -> Any:
    """The named `fields` of a record as its positional form (nested records too), defaults where absent."""
    if type(fields) is not dict:
        return fields
    out: list[Any] = []
    names, plan = _plan(cls)
    extra = fields.keys() - names
    if extra:
        raise _Unexpected(f"unexpected field {min(extra)!r}")
    for name, default, factory, inner, seq in plan:
        if name in fields:
            value = fields[name]
        elif default is not _MISSING:
            value = default
        elif factory is not None:
            value = factory()
        else:
            raise _Unexpected(f"missing field {name!r}")
        if inner is not None and value is not None:
            value = [_in_order(inner, v) for v in value] if seq and type(value) is list else _in_order(inner, value)
        out.append(value)
    return out


def _nested_record(annotation: Any) -> tuple[type[Record] | None, bool]:
    model, seq = _model_of(annotation)
    if model is not None and issubclass(model, Record):
        return model, seq
    return None, False


_PATH = re.compile(r" - at `\$((?:\[\d+\]|\.\w+)*)`$")
_STEP = re.compile(r"\[(\d+)\]|\.(\w+)")


def _named(cls: type[Record], message: str) -> str:
    """msgspec's `... - at `$[1][3]`` with the positions named by the record's fields: `trajectory.token_ids: ...`."""
    m = _PATH.search(message)
    if m is None:
        return message
    names: list[str] = []
    current: Any = cls  # a record class, (record class,) inside a sequence of records, or None
    for index, key in _STEP.findall(m.group(1)):
        if isinstance(current, tuple):
            names.append(index or key)
            current = current[0]
        elif index and isinstance(current, type) and issubclass(current, msgspec.Struct):
            f = msgspec.structs.fields(current)[int(index)]
            names.append(f.name)
            inner, seq = _nested_record(f.type)
            current = (inner,) if seq and inner is not None else inner
        else:
            names.append(index or key)
            current = None
    return f"{'.'.join(names)}: {message[: m.start()]}"


__all__ = [
    "PACKED_TYPES",
    "SHARED",
    "DecodeError",
    "Payload",
    "SharedDecodes",
    "Trust",
    "decode",
    "decode_shared",
    "encode",
    "named_form",
]
