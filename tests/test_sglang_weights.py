"""The SGLang rank's weight helpers that need no SGLang server (workers/engines/sglang_weights.py): which live
parameter holds which HF tensors, what a mismatch names, and the checkpoint directory a prepare writes. That the
checksums equal what a real SGLang server reports is checked in the SGLang tier (tests/sglang_tier)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from rolledger.workers.engines.sglang_weights import differing, expected_checksums, sglang_name, write_checkpoint


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (16, 8),
        "model.layers.0.self_attn.q_proj.weight": (8, 8),
        "model.layers.0.self_attn.k_proj.weight": (4, 8),
        "model.layers.0.self_attn.v_proj.weight": (4, 8),
        "model.layers.0.mlp.gate_proj.weight": (12, 8),
        "model.layers.0.mlp.up_proj.weight": (12, 8),
        "model.norm.weight": (8,),
    }
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def test_stacked_tensors_map_to_sglangs_fused_parameters_in_row_order() -> None:
    assert sglang_name("model.layers.3.self_attn.k_proj.weight") == ("model.layers.3.self_attn.qkv_proj.weight", 1)
    assert sglang_name("model.layers.3.self_attn.v_proj.bias") == ("model.layers.3.self_attn.qkv_proj.bias", 2)
    assert sglang_name("model.layers.0.mlp.up_proj.weight") == ("model.layers.0.mlp.gate_up_proj.weight", 1)
    assert sglang_name("model.norm.weight") == ("model.norm.weight", 0)
    checks = expected_checksums(state())
    assert set(checks) == {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.norm.weight",
    }
    assert checks["model.layers.0.self_attn.qkv_proj.weight"][1] == (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
    )


def test_a_change_in_any_part_of_a_fused_parameter_is_named_with_its_tensors() -> None:
    base = state()
    want = expected_checksums(base)
    live = {k: v[0] for k, v in want.items()}
    assert differing(want, live) == []
    changed = dict(base)
    changed["model.layers.0.self_attn.v_proj.weight"] = base["model.layers.0.self_attn.v_proj.weight"] * 2
    bad = differing(expected_checksums(changed), live)
    assert [(p, "model.layers.0.self_attn.v_proj.weight" in names) for p, names, _ in bad] == [
        ("model.layers.0.self_attn.qkv_proj.weight", True)
    ]
    # the embedding is compared padded to SGLang's 64-row vocabulary: its zero rows count, a changed row shows
    emb = dict(base)
    emb["model.embed_tokens.weight"] = base["model.embed_tokens.weight"].clone()
    emb["model.embed_tokens.weight"][-1, 0] += 1
    assert [p for p, _, _ in differing(expected_checksums(emb), live)] == ["model.embed_tokens.weight"]
    # a parameter served but in no tensor of the update, and one missing, are both named
    extra = {**live, "lm_head.weight": "0" * 16}
    del extra["model.norm.weight"]
    assert sorted(p for p, _, _ in differing(want, extra)) == ["lm_head.weight", "model.norm.weight"]


def test_write_checkpoint_holds_the_tensors_and_the_config_files_and_replaces_an_old_one(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    (model / "tokenizer.json").write_text("{}")
    out = tmp_path / "staging" / "v1"
    out.mkdir(parents=True)
    (out / "stale.safetensors").write_text("left by a crashed prepare")
    tensors = state()
    assert write_checkpoint(out, tensors, model) == out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    loaded = load_file(str(out / "model.safetensors"))
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert not list(tmp_path.glob("staging/*.partial"))
