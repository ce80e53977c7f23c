"""The weights side of an SGLang rank: the checkpoint directory an update is loaded from, and the checksums SGLang
must report for given HF-named tensors.

SGLang loads new weights from a directory (`/update_weights_from_disk`), so a prepared update is a checkpoint
directory: the verified tensors in `model.safetensors`, fsynced, beside a copy of the serving model's config files
(`write_checkpoint`). Nothing is loaded until commit.

SGLang's `/weights_checker {"action": "checksum"}` reports, per live parameter, the first 8 bytes of the sha256 of
its bytes (`sglang.srt.utils.weight_checker`, CPU path; `mm_utils.tensor_hash`). `expected_checksums` computes the
same from HF-named tensors, following how SGLang lays out Llama-family parameters:

- q/k/v projections are one `qkv_proj` parameter (rows of q, then k, then v), gate/up one `gate_up_proj`;
- the embedding and an untied lm_head are padded with zero rows to a multiple of 64 (`DEFAULT_VOCAB_PADDING_SIZE`);
- a tied lm_head is not a parameter of its own.

So a rank compares what SGLang says it serves with what the manifest says, parameter by parameter, and names the
tensors of a parameter that differs. A server that repacks or quantizes its weights (none does with the CPU
stand-in or unquantized bf16/fp32 on GPU) is refused at connect, because its start-up checksums do not match.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from rolledger.events.archive import fsync_path

VOCAB_PADDING = 64  # sglang.srt.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
_STACKED: tuple[tuple[str, str], ...] = (  # (SGLang parameter part, HF part), in the order SGLang concatenates rows
    (".qkv_proj.", ".q_proj."),
    (".qkv_proj.", ".k_proj."),
    (".qkv_proj.", ".v_proj."),
    (".gate_up_proj.", ".gate_proj."),
    (".gate_up_proj.", ".up_proj."),
)
_PADDED = ("model.embed_tokens.weight", "lm_head.weight")
CONFIG_FILES = (  # what a checkpoint directory needs besides its weights; copied from the serving model's directory
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def sglang_name(hf_name: str) -> tuple[str, int]:
    """The SGLang parameter an HF tensor lives in, and its place among the parameter's parts (0 when unstacked)."""
    for i, (param, part) in enumerate(_STACKED):
        if part in hf_name:
            same = [p for p, _ in _STACKED[: i + 1] if p == param]
            return hf_name.replace(part, param), len(same) - 1
    return hf_name, 0


def _bytes_of(name: str, t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if name in _PADDED and t.dim() == 2 and t.shape[0] % VOCAB_PADDING:
        pad = VOCAB_PADDING - t.shape[0] % VOCAB_PADDING
        t = torch.cat([t, torch.zeros(pad, t.shape[1], dtype=t.dtype)])
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def expected_checksums(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, tuple[str, ...]]]:
    """SGLang parameter name -> (the checksum /weights_checker must report for it, the HF tensors it holds)."""
    parts: dict[str, dict[int, str]] = {}
    for hf_name in tensors:
        param, index = sglang_name(hf_name)
        parts.setdefault(param, {})[index] = hf_name
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for param, by_index in parts.items():
        names = tuple(by_index[i] for i in sorted(by_index))
        h = hashlib.sha256()
        for n in names:
            h.update(_bytes_of(n, tensors[n]))
        out[param] = (h.hexdigest()[:16], names)
    return out


def differing(
    expected: Mapping[str, tuple[str, tuple[str, ...]]], live: Mapping[str, str]
) -> list[tuple[str, tuple[str, ...], str]]:
    """(SGLang parameter, its HF tensors, what is wrong) for every parameter whose live checksum is not expected."""
    bad: list[tuple[str, tuple[str, ...], str]] = []
    for param, (want, names) in expected.items():
        got = live.get(param)
        if got is None:
            bad.append((param, names, "not a parameter of the served model"))
        elif got != want:
            bad.append((param, names, f"live checksum {got}, expected {want}"))
    for param in sorted(set(live) - set(expected)):
        bad.append((param, (), "served but in no tensor of the update"))
    return bad


def write_checkpoint(directory: Path, tensors: Mapping[str, torch.Tensor], model_dir: Path) -> Path:
    """An SGLang-loadable checkpoint at `directory` (replaced if present): `tensors` in model.safetensors, fsynced,
    and the config files of `model_dir`."""
    tmp = directory.with_name(directory.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in CONFIG_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, tmp / name)
    weights = tmp / "model.safetensors"
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(weights))
    fsync_path(weights)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory
