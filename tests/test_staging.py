"""Tests for weight staging (workers/staging_*.py) and the weight manifest (schemas/weights.py).

Corruptions are made on disk by editing the real safetensors file (its header is parsed here independently of the
code under test), and a crash mid-write is a real killed process.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from safetensors.torch import save_file

from rolledger.schemas.weights import TensorEntry, WeightManifest, digest_entries
from rolledger.workers.weights import staging_loader, staging_store
from rolledger.workers.weights.staging_format import StagingError, path_from_uri
from rolledger.workers.weights.staging_loader import load_verified
from rolledger.workers.weights.staging_store import (
    DirectoryStagingStore,
    StagedUpdate,
    StagingStore,
    open_store,
    open_version,
    read_manifest,
)
from rolledger.workers.weights.tensors import state_digest, tensor_checksum

REPO = Path(__file__).resolve().parents[1]


def small_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(16, 8, generator=g)
    return {
        "model.embed_tokens.weight": emb,
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.ones(8, dtype=torch.float16),
        "model.norm.bias": torch.zeros(8),
        "lm_head.weight": emb,  # tied to the embedding: shares storage
        "step": torch.tensor(3, dtype=torch.int64),  # 0-dim
    }


def file_layout(path: Path) -> dict[str, tuple[int, int]]:
    """name -> absolute [start, end) of its bytes, read straight from the safetensors header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in header.items()}


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.fixture
def store(tmp_path: Path) -> DirectoryStagingStore:
    return DirectoryStagingStore(tmp_path / "staging")


def staged(store: DirectoryStagingStore, version: int = 1) -> tuple[StagedUpdate, Path]:
    upd = store.stage(version, version - 1, small_state())
    return upd, store.version_dir(version) / upd.manifest.file


def error_of(store: DirectoryStagingStore, upd: StagedUpdate, **kw: Any) -> StagingError:
    with pytest.raises(StagingError) as info:
        store.load_verified(upd.manifest.version, upd.manifest, **kw)
    return info.value


# ------------------------------------------------------------------------------------------------ round trip


def test_round_trip(store: DirectoryStagingStore) -> None:
    sd = small_state()
    upd = store.stage(1, 0, sd)
    assert isinstance(store, StagingStore)
    assert store.versions() == [1]
    assert upd.uri == (store.root / f"v000001-{upd.manifest_digest[:12]}").as_uri()
    assert upd.bytes == sum(t.numel() * t.element_size() for t in sd.values()) == upd.manifest.total_bytes
    assert upd.manifest_digest == upd.manifest.digest
    manifest = read_manifest(upd.uri, 1, expected_digest=upd.manifest_digest)
    assert manifest == upd.manifest

    loaded = load_verified(upd.uri, 1, manifest)
    assert list(loaded) == list(sd)
    for name, t in sd.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        assert torch.equal(loaded[name], t), name
    assert loaded.timings.nbytes == upd.bytes
    assert loaded.manifest_digest == upd.manifest_digest
    assert state_digest(loaded) == manifest.weights_digest == state_digest(sd)
    # the loaded tensors are private host memory, not views of each other (the tied pair was saved twice)
    assert loaded["lm_head.weight"].data_ptr() != loaded["model.embed_tokens.weight"].data_ptr()


def test_blake3_round_trip_and_checksum_detection(store: DirectoryStagingStore) -> None:
    upd = store.stage(1, 0, small_state(), checksum_algo="blake3")
    assert upd.manifest.checksum_algo == "blake3"
    assert all(len(t.checksum) == 64 for t in upd.manifest.tensors)
    loaded = store.load_verified(1, upd.manifest)
    assert state_digest(loaded) == state_digest(small_state())
    with pytest.raises(ValueError, match="xxh3_128"):
        _ = upd.manifest.weights_digest
    err = error_of(store, upd, corrupt="model.norm.bias")
    assert (err.kind, err.tensor) == ("checksum", "model.norm.bias")


def test_load_into_preallocated_buffers(store: DirectoryStagingStore) -> None:
    upd, _ = staged(store)
    out = {t.name: torch.full(t.shape, 7, dtype=getattr(torch, t.dtype)) for t in upd.manifest.tensors}
    loaded = store.load_verified(1, upd.manifest, out=out)
    for name, t in small_state().items():
        assert loaded[name] is out[name] and torch.equal(out[name], t)
    out["model.norm.bias"] = torch.zeros(9)
    with pytest.raises(ValueError, match="model.norm.bias"):
        store.load_verified(1, upd.manifest, out=out)


@pytest.mark.parametrize("algo", ["xxh3_128", "blake3"])
def test_chunked_read_and_hash(store: DirectoryStagingStore, monkeypatch: pytest.MonkeyPatch, algo: Any) -> None:
    """Tensors span many read chunks (7 bytes here): the streamed checksum matches and still catches one flip."""
    monkeypatch.setattr(staging_loader, "READ_CHUNK_BYTES", 7)
    upd = store.stage(1, 0, small_state(), checksum_algo=algo)
    loaded = store.load_verified(1, upd.manifest)
    assert state_digest(loaded) == state_digest(small_state())
    name = "model.layers.0.mlp.up_proj.weight"
    err = error_of(store, upd, corrupt=name)
    assert (err.kind, err.tensor) == ("checksum", name)
    path = store.version_dir(1) / upd.manifest.file
    end = file_layout(path)[name][1]
    flip_byte(path, end - 1)  # the last byte, in the last (short) chunk
    err = error_of(store, upd)
    assert (err.kind, err.tensor) == ("checksum", name)


# ------------------------------------------------------------------------------------------------ manifest


def entry(name: str = "w", shape: tuple[int, ...] = (2, 3), dtype: str = "bfloat16", **kw: Any) -> TensorEntry:
    nbytes = kw.pop("nbytes", math.prod(shape) * {"bfloat16": 2, "float32": 4}.get(dtype, 2))
    return TensorEntry(name=name, shape=shape, dtype=dtype, nbytes=nbytes, checksum=kw.pop("checksum", "0" * 32))


def manifest(**kw: Any) -> WeightManifest:
    tensors = kw.pop("tensors", (entry("a"), entry("b", (4,), "float32")))
    return WeightManifest(
        version=kw.pop("version", 2),
        base_version=kw.pop("base_version", 1),
        tensors=tensors,
        total_bytes=kw.pop("total_bytes", sum(t.nbytes for t in tensors)),
        **kw,
    )


def test_manifest_digest_is_stable() -> None:
    m = manifest()
    # pinned: a digest that changed between releases would make old logs unauditable
    assert m.digest == "62cca98780612a9c0d3f53ed045721c0"
    assert m.digest == WeightManifest.model_validate_json(m.model_dump_json()).digest
    assert m.digest == manifest(tensors=tuple(reversed(m.tensors))).digest  # tensor order does not matter
    assert m.digest == manifest(file="other.safetensors").digest  # where it is stored does not matter
    assert m.digest != manifest(version=3).digest
    assert m.digest != manifest(base_version=0).digest
    assert m.digest != manifest(tensors=(entry("a", checksum="1" * 32), entry("b", (4,), "float32"))).digest
    assert m.weights_digest == digest_entries(t.as_digest_entry() for t in m.tensors)


def test_manifest_digest_stable_across_stores(tmp_path: Path) -> None:
    a = DirectoryStagingStore(tmp_path / "a").stage(5, 4, small_state())
    b = DirectoryStagingStore(tmp_path / "b").stage(5, 4, dict(reversed(list(small_state().items()))))
    assert a.manifest_digest == b.manifest_digest
    c = DirectoryStagingStore(tmp_path / "c").stage(5, 4, {**small_state(), "model.norm.bias": torch.ones(8)})
    assert c.manifest_digest != a.manifest_digest


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: entry(dtype="float99"), "dtype"),
        (lambda: entry(nbytes=5), "nbytes"),
        (lambda: entry(shape=(2, -1)), "shape"),
        (lambda: entry(checksum="XYZ"), "checksum"),
        (lambda: manifest(total_bytes=1), "total_bytes"),
        (lambda: manifest(base_version=2), "base_version"),
        (lambda: manifest(version=0, base_version=0), "version"),
        (lambda: manifest(tensors=(entry("a"), entry("a"))), "duplicate tensor name 'a'"),
        (lambda: manifest(tensors=(entry("a", checksum="0" * 31),)), "tensor 'a' checksum"),
        (lambda: manifest(checksum_algo="blake3"), "blake3 gives 64"),
        (lambda: manifest(checksum_algo="md5"), "checksum_algo"),
        (lambda: manifest(file="../evil.safetensors"), "file"),
        (lambda: manifest(tensors=()), "tensors"),
        (lambda: manifest(extra_field=1), "extra_field"),
    ],
)
def test_invalid_manifest_names_the_field(build: Any, field: str) -> None:
    with pytest.raises(ValidationError, match=field.replace("(", r"\(")):
        build()


# ------------------------------------------------------------------------------------------------ failure modes


@pytest.mark.parametrize("name", list(small_state()))
def test_flipped_byte_names_the_tensor(store: DirectoryStagingStore, name: str) -> None:
    upd, path = staged(store)
    start, end = file_layout(path)[name]
    flip_byte(path, (start + end) // 2)
    err = error_of(store, upd)
    assert (err.kind, err.tensor) == ("checksum", name)
    assert name in str(err) and "version 1" in str(err)


def test_truncated_file_names_the_cut_tensor(store: DirectoryStagingStore) -> None:
    upd, path = staged(store)
    layout = file_layout(path)
    last = max(layout, key=lambda k: layout[k][1])
    start, end = layout[last]
    os.truncate(path, start + (end - start) // 2)
    err = error_of(store, upd)
    assert (err.kind, err.tensor) == ("truncated", last)


def test_file_truncated_inside_header(store: DirectoryStagingStore) -> None:
    upd, path = staged(store)
    os.truncate(path, 20)
    err = error_of(store, upd)
    assert err.kind == "unreadable" and err.tensor is None


def test_garbage_header(store: DirectoryStagingStore) -> None:
    upd, path = staged(store)
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe{]"
    path.write_bytes(bytes(data))
    err = error_of(store, upd)
    assert err.kind == "unreadable" and "header" in str(err)


def rewrite(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path))


def test_wrong_dtype_names_the_tensor(store: DirectoryStagingStore) -> None:
    upd, path = staged(store)
    sd = {k: v.clone() for k, v in small_state().items()}
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].to(torch.float16)
    rewrite(path, sd)
    err = error_of(store, upd)
    assert (err.kind, err.tensor) == ("dtype", "model.layers.0.mlp.up_proj.weight")
    assert "float16" in err.reason and "bfloat16" in err.reason


def test_wrong_shape_names_the_tensor(store: DirectoryStagingStore) -> None:
    upd, path = staged(store)
    sd = {k: v.clone() for k, v in small_state().items()}
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"].reshape(8, 16).contiguous()
    rewrite(path, sd)
    err = error_of(store, upd)
    assert (err.kind, err.tensor) == ("shape", "model.embed_tokens.weight")


def test_missing_and_extra_tensors_are_named(store: DirectoryStagingStore) -> None:
    upd, path = staged(store)
    sd = {k: v.clone() for k, v in small_state().items()}
    del sd["model.norm.bias"]
    rewrite(path, sd)
    err = error_of(store, upd)
    assert (err.kind, err.tensor) == ("missing", "model.norm.bias")

    sd = {k: v.clone() for k, v in small_state().items()}
    sd["intruder"] = torch.zeros(2)
    rewrite(path, sd)
    err = error_of(store, upd)
    assert (err.kind, err.tensor) == ("extra", "intruder")


def test_missing_file_and_wrong_manifest(store: DirectoryStagingStore) -> None:
    upd, path = staged(store)
    with pytest.raises(StagingError) as info:
        store.read_manifest(1, expected_digest="0" * 32)
    assert info.value.kind == "manifest"
    with pytest.raises(StagingError, match="manifest is for version 1, asked for 2") as info:
        store.load_verified(2, upd.manifest)
    assert info.value.kind == "manifest"
    path.unlink()
    assert error_of(store, upd).kind == "not_found"
    with pytest.raises(StagingError) as info:
        store.read_manifest(7)
    assert info.value.kind == "not_found"


def test_corrupt_injection_names_the_tensor(store: DirectoryStagingStore) -> None:
    upd, _ = staged(store)
    err = error_of(store, upd, corrupt="model.layers.0.input_layernorm.weight")
    assert (err.kind, err.tensor) == ("checksum", "model.layers.0.input_layernorm.weight")
    with pytest.raises(KeyError, match="nope"):
        store.load_verified(1, upd.manifest, corrupt="nope")
    store.load_verified(1, upd.manifest)  # the file itself is fine


def test_unstageable_input_is_named(store: DirectoryStagingStore) -> None:
    with pytest.raises(StagingError, match="'c'"):
        store.stage(1, 0, {"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(StagingError, match="empty"):
        store.stage(1, 0, {})
    with pytest.raises(ValidationError, match="base_version"):
        store.stage(1, 1, small_state())
    assert store.versions() == []


# ------------------------------------------------------------------------------------------------ atomicity


def test_failed_write_leaves_no_version(store: DirectoryStagingStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def half_write(tensors: dict[str, torch.Tensor], filename: str, metadata: Any = None) -> None:
        Path(filename).write_bytes(b"\x00" * 1000)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(staging_store, "save_file", half_write)
    with pytest.raises(OSError, match="No space"):
        store.stage(1, 0, small_state())
    assert store.versions() == []
    assert list(store.root.iterdir()) == []  # the temporary directory was removed too
    monkeypatch.undo()
    store.stage(1, 0, small_state())
    assert store.versions() == [1]


def test_killed_writer_leaves_no_version(store: DirectoryStagingStore) -> None:
    """A real crash: the writing process dies (os._exit) after half the file, before any cleanup can run."""
    script = f"""
import os, sys, torch
from pathlib import Path
from rolledger.workers.weights import staging_store
def die(tensors, filename, metadata=None):
    Path(filename).write_bytes(b"\\x00" * 1000)
    os._exit(3)
staging_store.save_file = die
staging_store.DirectoryStagingStore({str(store.root)!r}).stage(4, 3, {{"w": torch.zeros(4)}})
"""
    proc = subprocess.run([sys.executable, "-c", script], check=False, cwd=REPO, timeout=120, capture_output=True)
    assert proc.returncode == 3, proc.stderr.decode()
    leftovers = list(store.root.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".tmp-v000004-")
    assert store.versions() == []
    with pytest.raises(StagingError) as info:
        store.read_manifest(4)
    assert info.value.kind == "not_found"
    # a later writer of the same version is not blocked by the debris, and gc clears it once it is old
    store.stage(4, 3, {"w": torch.ones(4)})
    v5 = store.stage(5, 4, {"w": torch.ones(4)})
    assert store.gc(keep_versions=[5]) == [4]
    assert [p.name for p in store.root.iterdir()] == [path_from_uri(v5.uri).name]


def test_staging_is_content_addressed_and_idempotent(store: DirectoryStagingStore) -> None:
    """A trainer killed between staging and appending UpdateStaged stages the step again on restart: the same content
    is a no-op returning the existing record; other content goes to another directory (an unlogged orphan)."""
    upd, _ = staged(store)
    again, _ = staged(store)
    assert again.uri == upd.uri and again.manifest_digest == upd.manifest_digest
    assert path_from_uri(upd.uri).name == f"v000001-{upd.manifest_digest[:12]}"
    other = store.stage(1, 0, {"w": torch.zeros(1)})
    assert other.uri != upd.uri and other.manifest_digest != upd.manifest_digest
    assert read_manifest(upd.uri, 1, expected_digest=upd.manifest_digest) == upd.manifest
    assert read_manifest(other.uri, 1, expected_digest=other.manifest_digest) == other.manifest
    assert load_verified(other.uri, 1, other.manifest).tensors["w"].tolist() == [0.0]
    assert store.versions() == [1]


def test_staging_into_a_directory_holding_another_manifest_names_both(store: DirectoryStagingStore) -> None:
    upd, _ = staged(store)
    squatter = path_from_uri(store.stage(2, 1, {"w": torch.zeros(1)}).uri)
    wanted = store.stage(2, 1, {"w": torch.ones(1)})  # what a second writer would put at its own name
    shutil.rmtree(path_from_uri(wanted.uri))
    shutil.copytree(squatter, path_from_uri(wanted.uri))  # that name now holds the other manifest
    with pytest.raises(StagingError, match="holds manifest") as info:
        store.stage(2, 1, {"w": torch.ones(1)})
    assert info.value.kind == "exists"
    assert wanted.manifest_digest in str(info.value) and squatter.name[8:] in str(info.value)
    assert store.read_manifest(1) == upd.manifest


def test_gc_keeps_requested_and_newer_versions(store: DirectoryStagingStore) -> None:
    for v in range(1, 6):
        store.stage(v, v - 1, {"w": torch.full((2,), float(v))})
    assert store.gc(keep_versions=[2, 4]) == [1, 3]
    assert store.versions() == [2, 4, 5]  # 5 is newer than anything kept: maybe in flight, so kept
    assert store.gc(keep_versions=[]) == []


# ------------------------------------------------------------------------------------------------ URIs


def test_open_store_dispatches_on_scheme(tmp_path: Path) -> None:
    assert open_store(tmp_path.as_uri()).root == tmp_path
    assert open_store(str(tmp_path)).root == tmp_path
    with pytest.raises(ValueError, match="'s3'"):
        open_store("s3://bucket/staging")
    with pytest.raises(ValueError, match="host"):
        open_store("file://otherhost/x")
    assert open_version((tmp_path / "v000042").as_uri(), 42).root == tmp_path
    with pytest.raises(StagingError, match="not the directory of version 42") as info:
        open_version(tmp_path.as_uri(), 42)
    assert info.value.kind == "not_found"


def test_the_version_is_the_callers_and_the_manifest_must_be_for_it(store: DirectoryStagingStore) -> None:
    """The version comes from the command, never from the folder's name: a URI of another version's directory, a
    manifest of another version, or a manifest file rewritten to claim another version is a StagingError naming
    both versions."""
    upd, _ = staged(store)
    other = store.stage(2, 1, small_state())
    assert torch.equal(load_verified(upd.uri, 1, upd.manifest)["model.norm.bias"], torch.zeros(8))
    with pytest.raises(StagingError, match="not the directory of version 2"):
        load_verified(upd.uri, 2, other.manifest)
    with pytest.raises(StagingError, match="manifest is for version 2, asked for 1") as info:
        load_verified(upd.uri, 1, other.manifest)
    assert info.value.kind == "manifest"
    manifest_path = store.version_dir(1) / "manifest.json"
    manifest_path.write_text(other.manifest.model_dump_json())
    with pytest.raises(StagingError, match="is for version 2, asked for 1") as info:
        read_manifest(upd.uri, 1)
    assert info.value.kind == "manifest"


# ------------------------------------------------------------------------------------------------ property


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.uint8, torch.bool]


@st.composite
def state_dicts(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    names = draw(
        st.lists(
            st.from_regex(r"[a-z]{1,3}(\.[a-z0-9]{1,3}){0,2}", fullmatch=True), min_size=1, max_size=5, unique=True
        )
    )
    out = {}
    for name in names:
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if dtype == torch.bool:
            raw = bytes(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
        else:
            raw = draw(st.binary(min_size=n, max_size=n))  # any bit pattern, NaNs included
        out[name] = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
            if n
            else torch.empty(shape, dtype=dtype)
        )
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sd=state_dicts(), algo=st.sampled_from(["xxh3_128", "blake3"]))
def test_stage_load_round_trips(sd: dict[str, torch.Tensor], algo: Any) -> None:
    with tempfile.TemporaryDirectory() as d:
        store = DirectoryStagingStore(d, fsync=False)
        upd = store.stage(3, 2, sd, checksum_algo=algo)
        loaded = store.load_verified(3, read_manifest(upd.uri, 3, expected_digest=upd.manifest_digest))
        assert list(loaded) == list(sd)
        for name, t in sd.items():
            got = loaded[name]
            assert (got.dtype, got.shape) == (t.dtype, t.shape)
            assert tensor_checksum(got) == tensor_checksum(t), name  # byte-identical, NaN payloads included
        assert state_digest(loaded) == state_digest(sd)
        if algo == "xxh3_128":
            assert upd.manifest.weights_digest == state_digest(sd)


@pytest.mark.parametrize("before_bytes", [0, 10, 1 << 16])
def test_a_safetensors_file_written_in_place_reads_back_through_the_library(tmp_path: Path, before_bytes: int) -> None:
    """`overwrite_safetensors` (the dist store's write into a collected version's file) gives a file the
    safetensors library itself reads back tensor for tensor, with its metadata, whatever size the file had."""
    from safetensors import safe_open

    from rolledger.workers.weights.staging_checksums import raw_bytes
    from rolledger.workers.weights.staging_format import overwrite_safetensors, safetensors_layout
    from rolledger.workers.weights.tensors import dtype_name

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "b.bf16": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "a.f32": torch.randn(7, generator=gen),
        "c.i64": torch.arange(4, dtype=torch.int64),
        "d.scalar": torch.tensor(2.5, dtype=torch.float16),
        "e.mask": torch.tensor([True, False, True]),
        "f.empty": torch.zeros(0, 3),
        "g.u8": torch.arange(9, dtype=torch.uint8),
    }
    meta = {"version": "3", "base_version": "2"}
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"\xff" * before_bytes)
    specs = [(n, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for n, t in tensors.items()]
    head, offsets = safetensors_layout(specs, meta)
    size = len(head) + sum(s[3] for s in specs)
    overwrite_safetensors(path, head, [(offsets[n], raw_bytes(t)) for n, t in tensors.items()], size)
    assert path.stat().st_size == size
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == meta and set(f.keys()) == set(tensors)
        for name, want in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
