"""The tiny policy the project builds itself (no hub): a character tokenizer and a Qwen2-style causal LM.

Owns:
- `build_tokenizer()`: a `PreTrainedTokenizerFast` over the task's characters (digits, '+', '=', ' ') plus the
  special tokens <pad>/<bos>/<eos>, built with the `tokenizers` library (WordLevel over single characters), so
  `save_pretrained` writes a standard tokenizer.json that `AutoTokenizer` (and vLLM) can load. Encoding prepends
  <bos>; decoding concatenates characters.
- `build_model(cfg, vocab_size, seed)`: a randomly initialised `Qwen2ForCausalLM` (tied embeddings; head_dim =
  hidden/heads must be 64 so vLLM's CPU attention accepts the same checkpoint).
- `policy_state(model)`: the name -> tensor map that *is* the policy's weights everywhere in the project (what the
  trainer stages, what engines validate against and digest). Tied weights appear once (`lm_head.weight` is the
  embedding, as in the safetensors checkpoint), so the digest of trainer and engine agree.
- `save_policy(dir, model, tokenizer)` / `load_policy(dir)`: a safetensors checkpoint via `save_pretrained`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from rolledger.schemas.config import ModelConfig

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
TASK_CHARS = "0123456789+= "
HEAD_DIM = 64  # vLLM's CPU attention backend supports head sizes like 64/128; keep the tiny model on 64.

# transformers' per-file progress bars ('Loading weights', 'Writing model shards') for a one-file checkpoint are noise
# in every process's log; the run's own progress says what it is doing
hf_logging.disable_progress_bar()


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: ids 0..2 are <pad>, <bos>, <eos>; then one id per task character."""
    vocab = {PAD: 0, BOS: 1, EOS: 2}
    for ch in TASK_CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token=PAD))
    # every character is its own token (special tokens are matched before pre-tokenization)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.add_special_tokens([PAD, BOS, EOS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=PAD, padding_side="right"
    )


def model_config(cfg: ModelConfig, vocab_size: int) -> Qwen2Config:
    """The Qwen2Config for a ModelConfig; raises ValueError naming the field when head_dim would not be 64."""
    if cfg.hidden_size % cfg.num_attention_heads != 0 or cfg.hidden_size // cfg.num_attention_heads != HEAD_DIM:
        raise ValueError(
            f"model.hidden_size / model.num_attention_heads must be {HEAD_DIM} "
            f"(got {cfg.hidden_size}/{cfg.num_attention_heads})"
        )
    if cfg.num_attention_heads % cfg.num_key_value_heads != 0:
        raise ValueError(
            f"model.num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
            f"model.num_key_value_heads ({cfg.num_key_value_heads})"
        )
    kwargs: dict[str, Any] = dict(  # noqa: C408 - keyword names as in Qwen2Config
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        use_sliding_window=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        dtype=cfg.dtype,
    )
    return Qwen2Config(**kwargs)


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> Qwen2ForCausalLM:
    """A freshly initialised tiny Qwen2 causal LM in `cfg.dtype`, deterministic for a given seed."""
    hf_cfg = model_config(cfg, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(hf_cfg)
    model = model.to(getattr(torch, cfg.dtype))
    model.eval()
    return model


def policy_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> live tensor of the policy's weights (parameters, tied ones once). No copies are made."""
    return {name: p.data for name, p in model.named_parameters()}


def save_policy(directory: str | Path, model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast) -> Path:
    """Write model (safetensors, in the model's dtype) and tokenizer to `directory`; returns the path."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def load_policy(directory: str | Path) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """Load what `save_policy` wrote (the checkpoint's dtype is kept)."""
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no policy checkpoint (config.json) in {path}")
    model = Qwen2ForCausalLM.from_pretrained(path, dtype="auto")
    model.eval()
    # explicit class: AutoTokenizer would map the qwen2 config to Qwen2Tokenizer; ours is a plain tokenizer.json
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    return model, tokenizer
