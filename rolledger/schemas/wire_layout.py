"""The positional wire layout of every event payload, and the lock that keeps old entries readable.

An event on the wire is a msgpack array `[type, version, envelope, payload]` (events/codec.py) where the envelope and
every payload model are arrays of their field values in declaration order, not maps of name -> value: msgpack then
decodes no key strings and builds no dicts, which made unpacking 2.5-3.5x faster and entries 40-60% smaller
(SampleFinished 976 -> 576 bytes; `python bench/bench_replay.py` prints the figures).

A layout names the positions. It is a list of fields `[name, kind, sub]`:
- kind "v": a plain value (scalar, enum value, list of scalars, or a map-encoded model, see `MAP_ENCODED`);
- kind "a": a packed array (schemas.base.PackedArraySchema), sub its typecode;
- kind "m": a nested model (or None where the field is optional), sub its layout;
- kind "ms": a tuple/list of nested models, sub their layout.

A layout is part of a payload type's schema version. `wire_layouts.json` locks the layout of every (type, version)
ever written positionally, so an entry keeps its meaning after the models change: at import, each current type's
layout derived from its model must equal the locked one for its SCHEMA_VERSION (`check_locked`), else the import fails
naming the type. To change a payload's fields: bump its SCHEMA_VERSION, add its upcaster (schemas/events.py), then
`python -m rolledger.schemas.wire_layout --write`, which adds the new version's layout and never rewrites a locked one.

`MAP_ENCODED` models (the run's config) stay self-describing maps inside a positional payload: they gain defaulted
fields release by release, and one RunStarted per run is no cost worth a schema version per config option.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from pydantic import BaseModel

from rolledger.schemas.base import PackedField
from rolledger.schemas.wire import MAP_ENCODED

LOCK_PATH = Path(__file__).with_name("wire_layouts.json")
# The envelope's positions. It is versioned by its length, not by a number: a field is only ever added at the end,
# defaulted, so every older envelope is a prefix of the current one (msgspec fills the missing tail with defaults on
# the typed path). v1 (7 fields): every log before issue 41. v2 (8): `append`, the writer's AppendMark
# (schemas/events.py) as [origin, n, acked] or nil. events/codec.py checks at import that its envelope record has
# exactly these fields.
ENVELOPE_V1_FIELDS = ("event_id", "run_id", "producer", "causation_id", "correlation_id", "policy_version", "wall_time")
ENVELOPE_FIELDS = (*ENVELOPE_V1_FIELDS, "append")
ENVELOPE_LENGTHS = (len(ENVELOPE_V1_FIELDS), len(ENVELOPE_FIELDS))  # every envelope length ever written

Field = list[Any]  # [name, kind, sub]
Layout = list[Field]
Positional = type  # a Record (msgspec.Struct) or a pydantic model that is not MAP_ENCODED


def _strip(annotation: Any) -> Any:
    """The annotation without its Annotated metadata."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _is_positional(annotation: Any) -> bool:
    return isinstance(annotation, type) and (
        issubclass(annotation, msgspec.Struct)
        or (issubclass(annotation, BaseModel) and annotation.__name__ not in MAP_ENCODED)
    )


def _model_of(annotation: Any) -> tuple[Positional | None, bool]:
    """(positional record or model class, is-a-sequence) where the annotation is M, M | None, tuple[M, ...], list[M]."""
    annotation = _strip(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _model_of(rest[0])[0], False
        return None, False
    if origin in (tuple, list) and args and (args[1:] in ((), (Ellipsis,))):
        inner, seq = _model_of(args[0])
        return (inner, True) if inner is not None and not seq else (None, False)
    if _is_positional(annotation):
        return annotation, False
    return None, False


def _typecode(annotation: Any) -> str | None:
    """The wire typecode of a packed-array field (schemas.base.PackedField), None for any other."""
    if typing.get_origin(annotation) is typing.Annotated:
        marker = next((m for m in annotation.__metadata__ if isinstance(m, PackedField)), None)
        if marker is not None:
            return marker.cls.TYPECODE
    return None


def _annotations(cls: type) -> list[tuple[str, Any]]:
    """(field name, annotation) of a record or pydantic model, in declaration order (the wire's order)."""
    if issubclass(cls, msgspec.Struct):
        return [(f.name, f.type) for f in msgspec.structs.fields(cls)]
    assert issubclass(cls, BaseModel), cls
    return [(name, info.annotation) for name, info in cls.model_fields.items()]


def _fields(cls: type, skip: tuple[str, ...]) -> list[tuple[str, str | None, Positional | None, bool]]:
    """(name, packed typecode, positional model, is-a-sequence) of `cls`'s fields in declaration order, less `skip`."""
    return [(name, _typecode(ann), *_model_of(ann)) for name, ann in _annotations(cls) if name not in skip]


def layout_of(cls: type, skip: tuple[str, ...] = ()) -> Layout:
    """The layout of `cls`'s fields in declaration order, less `skip` (a payload's `type`, which the frame carries)."""
    out: Layout = []
    for name, typecode, model, seq in _fields(cls, skip):
        if typecode is not None:
            out.append([name, "a", typecode])
        elif model is not None:
            out.append([name, "ms" if seq else "m", layout_of(model)])
        else:
            out.append([name, "v", None])
    return out


def current_layouts() -> dict[str, dict[str, Layout]]:
    """{type: {str(SCHEMA_VERSION): layout}} for every payload type as the models stand now."""
    from rolledger.schemas.events import PAYLOAD_TYPES

    return {name: {str(cls.SCHEMA_VERSION): layout_of(cls)} for name, cls in PAYLOAD_TYPES.items()}


def load_locked(path: Path = LOCK_PATH) -> dict[str, dict[str, Layout]]:
    data: dict[str, dict[str, Layout]] = json.loads(path.read_text())
    return data


def check_locked(locked: dict[str, dict[str, Layout]]) -> None:
    """Raise RuntimeError naming every type whose current layout is missing from, or differs from, the lock."""
    problems = []
    for name, by_version in current_layouts().items():
        ((version, layout),) = by_version.items()
        have = locked.get(name, {}).get(version)
        if have is None:
            problems.append(f"{name} v{version} has no locked wire layout")
        elif have != layout:
            problems.append(f"{name} v{version}'s fields differ from its locked wire layout")
    if problems:
        raise RuntimeError(
            "; ".join(problems) + f" ({LOCK_PATH.name}): a changed payload needs a new SCHEMA_VERSION and an upcaster, "
            "then `python -m rolledger.schemas.wire_layout --write`"
        )


def write_lock(path: Path = LOCK_PATH) -> list[str]:
    """Add the current layouts to the lock; a locked (type, version) is never rewritten. Returns what was added."""
    locked = load_locked(path) if path.exists() else {}
    added = []
    for name, by_version in current_layouts().items():
        ((version, layout),) = by_version.items()
        have = locked.setdefault(name, {}).get(version)
        if have is None:
            locked[name][version] = layout
            added.append(f"{name} v{version}")
        elif have != layout:
            raise RuntimeError(f"{name} v{version} is locked with other fields: bump its SCHEMA_VERSION first")
    lines = [f"  {json.dumps(name)}: {json.dumps(locked[name], sort_keys=True)}" for name in sorted(locked)]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one line per type: a diff shows the type that changed
    return added


if __name__ == "__main__":  # pragma: no cover - a maintainer's command
    if sys.argv[1:] != ["--write"]:
        print("usage: python -m rolledger.schemas.wire_layout --write", file=sys.stderr)
        raise SystemExit(2)
    print("\n".join(write_lock()) or "nothing to add")


# ---------------------------------------------------------------- encode and name by a layout
class LayoutMismatch(ValueError):
    """A positional value of another shape than its layout (wrong length, not an array)."""


Namer = Callable[[Any], dict[str, Any]]


def namer(layout: Layout) -> Namer:
    """The function turning a positional value of `layout` back into the map of its fields (nested ones too), for the
    validating decode and upcasters; raises LayoutMismatch for a value of another shape."""
    names = tuple(f[0] for f in layout)
    count = len(names)
    nested = tuple((f[0], f[1] == "ms", namer(f[2])) for f in layout if f[1] in ("m", "ms"))

    def mismatch(values: Any) -> LayoutMismatch:
        got = f"{len(values)} fields" if type(values) is list else type(values).__name__
        return LayoutMismatch(f"{got} where its layout has {count} ({', '.join(names)})")

    if not nested:  # a flat model (most payloads): one C call

        def flat(values: Any) -> dict[str, Any]:
            if type(values) is not list or len(values) != count:
                raise mismatch(values)
            return dict(zip(names, values))

        return flat

    def name(values: Any) -> dict[str, Any]:
        if type(values) is not list or len(values) != count:
            raise mismatch(values)
        d = dict(zip(names, values))
        for field, seq, inner in nested:
            value = d[field]
            if value is not None:
                if seq and type(value) is not list:
                    raise LayoutMismatch(f"{field}: {type(value).__name__} where a list of models belongs")
                d[field] = [inner(v) for v in value] if seq else inner(value)
        return d

    return name
