"""Real Hugging Face checkpoints (tiny, random, written by transformers into tmp dirs): Qwen2 and Llama load through
`load_policy` (AutoConfig / AutoModelForCausalLM, local files only) and run forward; an architecture the engine cannot
serve (GPT-2), a checkpoint with a tensor missing and one without a tokenizer are refused in one line naming what is
wrong; and the real loop runs end to end on a Llama policy, built by the run or given as `--model-dir` (used as is).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import pytest
import redis
import torch
from safetensors.torch import load_file, save_file
from test_run_loop import execute, of, small
from transformers import GPT2Config, GPT2LMHeadModel

from rolledger.events.store import EventLog
from rolledger.schemas import events as ev
from rolledger.schemas.config import ModelConfig
from rolledger.workers.operator.cli import main
from rolledger.workers.operator.local_run import LocalRun, RunOptions, prepare_policy
from rolledger.workers.policy.checkpoints import CheckpointRefused
from rolledger.workers.policy.policy_model import build_model, build_tokenizer, load_policy, policy_state, save_policy
from rolledger.workers.weights.tensors import state_digest
from rolledger.workflows.audit import audit

Architecture = Literal["qwen2", "llama"]
CLASSES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


def checkpoint(directory: Path, architecture: Architecture = "qwen2") -> Path:
    """A tiny random checkpoint of `architecture` with the project's tokenizer, as transformers saves it."""
    tok = build_tokenizer()
    save_policy(directory, build_model(ModelConfig(architecture=architecture), len(tok), 0), tok)
    return directory


def refusal(directory: Path) -> str:
    with pytest.raises(CheckpointRefused) as info:
        load_policy(directory)
    message = str(info.value)
    assert "\n" not in message and str(directory) in message
    return message


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_a_checkpoint_loads_as_its_own_architecture_and_runs_forward(
    tmp_path: Path, architecture: Architecture
) -> None:
    path = checkpoint(tmp_path / architecture, architecture)
    built = state_digest(policy_state(build_model(ModelConfig(architecture=architecture), 16, 0)))
    model, tokenizer = load_policy(path)
    assert type(model).__name__ == CLASSES[architecture] and model.config.model_type == architecture
    assert state_digest(policy_state(model)) == built  # every weight from the file, none re-initialised
    ids = tokenizer("12+34=")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 7
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, 7, len(tokenizer)) and bool(torch.isfinite(logits).all())


def test_a_tokenizer_of_a_named_class_loads_through_auto_tokenizer(tmp_path: Path) -> None:
    path = checkpoint(tmp_path, "llama")
    plain = load_policy(path)[1]
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    _, tokenizer = load_policy(path)
    assert type(tokenizer).__name__ == "LlamaTokenizer" and type(plain).__name__ != "LlamaTokenizer"
    assert tokenizer("12+34=")["input_ids"] == plain("12+34=")["input_ids"]
    assert tokenizer.eos_token_id == plain.eos_token_id == 2


def test_an_unsupported_architecture_is_refused_in_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=1, vocab_size=16, n_positions=32)).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    message = refusal(path)
    assert "'gpt2' (GPT2LMHeadModel) is not supported" in message
    assert "llama (LlamaForCausalLM), qwen2 (Qwen2ForCausalLM)" in message
    # the command line refuses it before anything starts: exit 2, one line, no run directory
    runs = tmp_path / "runs"
    assert main(["run", "--model-dir", str(path), "--runs-dir", str(runs), "--run-id", "r1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rolledger run: checkpoint ") and "'gpt2'" in err and "\n" not in err
    assert not (runs / "r1").exists()


def test_a_checkpoint_missing_a_tensor_is_refused_naming_it(tmp_path: Path) -> None:
    path = checkpoint(tmp_path, "llama")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    message = refusal(path)
    assert "LlamaForCausalLM (missing model.layers.1.self_attn.k_proj.weight)" in message


def test_qwen2_weights_under_a_llama_config_are_refused_for_their_unexpected_biases(tmp_path: Path) -> None:
    """The silent-reinit hazard the other way round: Qwen2 weights (q/k/v biases) under a Llama config."""
    path = checkpoint(tmp_path, "qwen2")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps({**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    message = refusal(path)
    assert "unexpected model.layers.0.self_attn.k_proj.bias" in message


def test_a_sliding_window_model_is_refused(tmp_path: Path) -> None:
    path = checkpoint(tmp_path, "qwen2")
    config = json.loads((path / "config.json").read_text())
    config.pop("layer_types", None)
    config.update(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    (path / "config.json").write_text(json.dumps(config))
    assert "sliding_attention" in refusal(path)


def test_a_checkpoint_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    build_model(ModelConfig(architecture="llama"), 16, 0).save_pretrained(tmp_path)
    assert "no tokenizer" in refusal(tmp_path)


def model_of(events: list[ev.Event]) -> dict[str, object]:
    """The config.json of the policy the run started from (RunStarted.model_dir)."""
    started = of(events, ev.RunStarted)[0]
    config: dict[str, object] = json.loads((Path(started.model_dir) / "config.json").read_text())
    return config


@pytest.mark.slow
def test_the_loop_runs_end_to_end_on_a_llama_policy(redis_url: str, run_id: str, tmp_path: Path) -> None:
    events, summary = execute(redis_url, run_id, tmp_path, small(model={"architecture": "llama"}))
    assert summary.status == "completed" and summary.steps == 3
    assert audit(events).ok
    config = model_of(events)
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    trajectories = [p.trajectory for p in of(events, ev.SampleFinished)]
    # samples on the initial policy and on at least one published version (which one races the trainer: a run of
    # 3 steps may publish v2 before any group starts on v1)
    assert trajectories and {t.policy_version for t in trajectories} > {0}


@pytest.mark.slow
def test_a_run_on_a_given_checkpoint_uses_it_as_is(redis_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = small(model={"architecture": "llama"})
    given = tmp_path / "my-llama"
    prepare_policy(cfg, given)  # a warm-started Llama checkpoint the user brings
    digest = state_digest(policy_state(load_policy(given)[0]))
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in given.iterdir()}
    run = LocalRun(RunOptions(config=cfg, redis_url=redis_url, run_id=run_id, runs_dir=tmp_path, model_dir=given))
    summary = run.execute()
    assert summary.status == "completed"
    client = redis.Redis.from_url(redis_url)
    events = [s.event for s in EventLog(client, run_id).read()]
    client.close()
    started = of(events, ev.RunStarted)[0]
    assert started.model_dir == str(given) and started.initial_weights_digest == digest
    assert not (tmp_path / run_id / "model").exists()  # no policy of its own was built
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in given.iterdir()} == before  # untouched
    assert model_of(events)["model_type"] == "llama" and audit(events).ok
