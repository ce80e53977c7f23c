"""The policy: the tiny one the project builds itself (no hub), and loading any supported Hugging Face checkpoint.

Owns:
- `build_tokenizer()`: a `PreTrainedTokenizerFast` over the task's characters (digits, '+', '=', ' ') plus the
  special tokens <pad>/<bos>/<eos>, built with the `tokenizers` library (WordLevel over single characters), so
  `save_pretrained` writes a standard tokenizer.json that `AutoTokenizer` (and vLLM) can load. Encoding prepends
  <bos>; decoding concatenates characters.
- `build_model(cfg, vocab_size, seed)`: a randomly initialised causal LM of `cfg.architecture` (Qwen2 or Llama,
  through `AutoConfig.for_model` / `AutoModelForCausalLM.from_config`; tied embeddings; head_dim = hidden/heads must
  be 64 so vLLM's CPU attention accepts the same checkpoint).
- `policy_state(model)`: the name -> tensor map that *is* the policy's weights everywhere in the project (what the
  trainer stages, what engines validate against and digest). Tied weights appear once (`lm_head.weight` is the
  embedding, as in the safetensors checkpoint), so the digest of trainer and engine agree.
- `save_policy(dir, model, tokenizer)` / `load_policy(dir)`: a safetensors checkpoint via `save_pretrained`; loading
  takes any local checkpoint of a supported architecture (workers/policy/checkpoints.py) through `AutoModelForCausalLM`,
  never from the network, and refuses (`CheckpointRefused`, one line) an unsupported architecture, a model that is
  not full-attention only, weights transformers reports missing / unexpected / mismatched (it would initialise them
  at random), and a directory without a tokenizer. The tokenizer: a plain tokenizer.json (ours: tokenizer_class
  `TokenizersBackend` / `PreTrainedTokenizerFast`, or no tokenizer_config.json) loads as `PreTrainedTokenizerFast`
  (AutoTokenizer would map a qwen2 config to Qwen2Tokenizer); any other class through `AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from rolledger.schemas.config import ModelConfig
from rolledger.workers.policy.checkpoints import CheckpointRefused, checkpoint_model_type

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


def model_config(cfg: ModelConfig, vocab_size: int) -> PretrainedConfig:
    """The transformers config of `cfg.architecture` for a ModelConfig; raises ValueError naming the field when
    head_dim would not be 64."""
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
    kwargs: dict[str, Any] = dict(  # noqa: C408 - keyword names as in the transformers configs
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        dtype=cfg.dtype,
    )
    if cfg.architecture == "qwen2":
        kwargs["use_sliding_window"] = False
    return AutoConfig.for_model(cfg.architecture, **kwargs)


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> PreTrainedModel:
    """A freshly initialised tiny causal LM of `cfg.architecture` in `cfg.dtype`, deterministic for a given seed."""
    hf_cfg = model_config(cfg, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: PreTrainedModel = AutoModelForCausalLM.from_config(hf_cfg)
    model = model.to(getattr(torch, cfg.dtype))
    model.eval()
    return model


def policy_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> live tensor of the policy's weights (parameters, tied ones once). No copies are made."""
    return {name: p.data for name, p in model.named_parameters()}


def save_policy(directory: str | Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Path:
    """Write model (safetensors, in the model's dtype) and tokenizer to `directory`; returns the path."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def load_policy(directory: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a local checkpoint of a supported architecture (the checkpoint's dtype is kept); CheckpointRefused (one
    line) for one the engine cannot serve or transformers could not load in full. Nothing is fetched."""
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no policy checkpoint (config.json) in {path}")
    checkpoint_model_type(path)  # the architecture, from config.json: refused before transformers reads anything
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise CheckpointRefused(
            f"checkpoint {path}: layer types {sorted(layer_types)}; the torch engine serves full attention only"
        )
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # transformers' multi-line load report: the refusal below says it in one line
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(  # (model, loading info) with output_loading_info
            path, config=config, dtype="auto", local_files_only=True, output_loading_info=True
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    model: PreTrainedModel = loaded[0]
    info: dict[str, Any] = loaded[1]
    problems = [
        f"{what} {_names(info.get(key))}"
        for key, what in (
            ("missing_keys", "missing"),
            ("unexpected_keys", "unexpected"),
            ("mismatched_keys", "mismatched"),
        )
        if info.get(key)
    ]
    if problems:
        raise CheckpointRefused(
            f"checkpoint {path}: its weights do not match {type(model).__name__} ({'; '.join(problems)}); "
            "refused rather than run with weights transformers would initialise at random or drop"
        )
    model.eval()
    return model, load_tokenizer(path)


def load_tokenizer(directory: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer: a plain tokenizer.json (the project's own) as `PreTrainedTokenizerFast`, any other
    tokenizer class through `AutoTokenizer`; CheckpointRefused when there is none."""
    path = Path(directory)
    config_file = path / "tokenizer_config.json"
    if not config_file.is_file() and not (path / "tokenizer.json").is_file():
        raise CheckpointRefused(f"checkpoint {path}: no tokenizer (neither tokenizer.json nor tokenizer_config.json)")
    tokenizer_class: object = None
    if config_file.is_file():
        try:
            tokenizer_class = json.loads(config_file.read_text()).get("tokenizer_class")
        except (OSError, ValueError, AttributeError) as e:
            raise CheckpointRefused(f"checkpoint {path}: cannot read tokenizer_config.json: {e}") from None
    try:
        if (
            tokenizer_class in (None, "TokenizersBackend", "PreTrainedTokenizerFast")
            and (path / "tokenizer.json").is_file()
        ):
            # explicit class: AutoTokenizer would map a qwen2 config to Qwen2Tokenizer; ours is a plain tokenizer.json
            return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointRefused(f"checkpoint {path}: no tokenizer it can load: {' '.join(str(e).split())}") from None
    return tokenizer


def _names(keys: object, limit: int = 8) -> str:
    """Sorted tensor names, at most `limit`, then how many more."""
    names = sorted(str(k) for k in keys) if isinstance(keys, (set, list, tuple)) else [str(keys)]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
