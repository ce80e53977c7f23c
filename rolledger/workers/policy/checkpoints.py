"""Which Hugging Face checkpoints a run can use, decided from the checkpoint's config.json alone (no torch, no
transformers: `rolledger run --model-dir DIR` refuses an unsupported one before anything heavy is imported).

Owns:
- `SUPPORTED_ARCHITECTURES`: model_type -> causal-LM class of the architectures the torch engine and the trainer
  serve. The torch engine (workers/engines/torch_decode.py) calls `model(input_ids, past_key_values=DynamicCache)`,
  reads `.logits`, and rebuilds / expands the cache per layer from its keys and values; Qwen2 and Llama (decoder-only,
  full attention, RoPE) are the ones built and exercised here (tests/test_hf_checkpoints.py).
- `CheckpointRefused`: a checkpoint the run cannot use, one line naming the directory and the reason (a `RunRefused`,
  so the CLI prints it as one line and starts nothing).
- `checkpoint_model_type(dir)`: the checkpoint's model_type, or `CheckpointRefused` naming the model_type and
  architectures it has and what is supported.
"""

from __future__ import annotations

import json
from pathlib import Path

from rolledger.workers.policy.run_inputs import RunRefused

SUPPORTED_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class CheckpointRefused(RunRefused):
    """A checkpoint directory the run cannot use (unsupported architecture, missing weights, no tokenizer)."""


def supported_text() -> str:
    """'llama (LlamaForCausalLM), qwen2 (Qwen2ForCausalLM)': what the refusals name as supported."""
    return ", ".join(f"{t} ({cls})" for t, cls in sorted(SUPPORTED_ARCHITECTURES.items()))


def checkpoint_model_type(directory: str | Path) -> str:
    """The `model_type` of the checkpoint in `directory` when the project supports it; else CheckpointRefused."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointRefused(f"checkpoint {path}: cannot read it: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointRefused(f"checkpoint {path}: not a JSON object")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        architectures = config.get("architectures")
        named = f" ({', '.join(map(str, architectures))})" if isinstance(architectures, list) and architectures else ""
        raise CheckpointRefused(
            f"checkpoint {path.parent}: architecture {model_type!r}{named} is not supported by the torch engine and "
            f"trainer; supported: {supported_text()}"
        )
    return str(model_type)
