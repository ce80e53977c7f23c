"""Partial rollouts on a real vLLM CPU server.

- A group closed while its samples run (first k reached) is cut short in the engine: the request is aborted on the
  server (its sequences leave the batch: the server's own counters say so), and the cancelled samples come back with
  the tokens they had, fewer than `max_tokens`.
- A sample interrupted by a whole weight update (pause "keep", prepare, commit, health, resume) continues under the
  new version, its spans saying where that version begins.

The server serves a small policy with a long context whose end-of-sequence token can never be sampled (its output
row is zero while every other row is scaled up), so every sample runs to `max_tokens` unless it is cut.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
from engine_contract import generate_in_thread

from rolledger.schemas.config import ModelConfig, SamplingParams
from rolledger.workers.engines.protocol import GroupOutput, SampleOutput

from .conftest import PROMPT, free_port, skip_reason, vllm_import_error

pytestmark = pytest.mark.vllm

MAX_TOKENS = 600
# big enough that a decode step takes tens of milliseconds on a CPU: the server cannot outrun the client by a whole
# sample, even on a loaded machine (a tiny model finished 2,000 tokens before a pause 20 streamed tokens in could land)
_ENDLESS = ModelConfig(
    dtype="bfloat16",
    max_position_embeddings=2048,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
)


def _endless_checkpoint(directory: Path) -> Path:
    """A Qwen2 of about 100M parameters with 2,048 positions that never ends a sample: the EOS row of the tied embedding is zero and the
    others are scaled by 50, so a token's own logit dwarfs EOS's."""
    import torch

    from rolledger.workers.policy.policy_model import build_model, build_tokenizer, save_policy

    tok = build_tokenizer()
    model = build_model(_ENDLESS, len(tok), seed=0)
    with torch.no_grad():
        emb = cast(torch.Tensor, model.get_input_embeddings().weight)
        emb.mul_(50.0)
        emb[int(tok.eos_token_id)] = 0.0
    return save_policy(directory, model, tok)


@dataclass
class Server:
    url: str
    model: str


@pytest.fixture(scope="module")
def endless_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if vllm_import_error():
        pytest.skip(skip_reason())
    from rolledger.workers.engines.vllm_server import start_vllm_server

    root = tmp_path_factory.mktemp("vllm_partial")
    model_dir = _endless_checkpoint(root / "model")
    server = start_vllm_server(model_dir, free_port(), log_path=root / "vllm.log", max_model_len=2048)
    try:
        yield Server(server.url, str(model_dir))
    finally:
        server.close()


def _metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (every label set) in vLLM's /metrics text."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m:
            total += float(m.group(2))
    return total


def test_first_k_cancels_the_samples_still_running_in_the_server(endless_server: Server) -> None:
    from rolledger.workers.engines.vllm_engine import VllmEngine

    e = VllmEngine(endless_server.url, rank=0, model_name=endless_server.model, timeout_s=120.0)
    try:
        sampling = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=3, logprob_mode="raw")
        generated_before = _metric(e.http.request("GET", "/metrics").text, "vllm:generation_tokens_total")

        polls = 0

        def closed(_: int) -> bool:  # the group is closed after the first few streamed events (first k reached)
            nonlocal polls
            polls += 1
            return polls > 40

        ended: list[tuple[int, SampleOutput]] = []
        out = e.generate(PROMPT, 4, sampling, should_cancel=closed, on_sample=lambda i, s: ended.append((i, s)))
        assert ended == []  # nothing ended before the close: every sample was still running
        assert [s.finish_reason for s in out.samples] == ["abort"] * 4
        lengths = [len(s.token_ids) for s in out.samples]
        assert all(0 < n < MAX_TOKENS for n in lengths), lengths
        assert all(len(s.logprobs) == len(s.token_ids) for s in out.samples)
        assert e.stats.cancelled_samples == 4 and e.stats.cancelled_tokens == sum(lengths)

        # the server aborted the request: nothing of it runs, and it generated far fewer than 4 x max_tokens tokens
        deadline = time.monotonic() + 30.0
        while True:
            text = e.http.request("GET", "/metrics").text
            if _metric(text, "vllm:num_requests_running") == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # polling the server's state under a deadline, not waiting for an event of ours
        assert _metric(text, "vllm:num_requests_running") == 0
        generated = _metric(text, "vllm:generation_tokens_total") - generated_before
        print(f"\ncancelled after {lengths} tokens; the server generated {generated:.0f} of {4 * MAX_TOKENS}")
        assert generated < 4 * MAX_TOKENS / 4, generated

        # the same request left to run: every sample runs to max_tokens, each handed over as it ends
        ended.clear()
        full = e.generate(PROMPT, 2, sampling, on_sample=lambda i, s: ended.append((i, s)))
        assert [s.finish_reason for s in full.samples] == ["length", "length"]
        assert [len(s.token_ids) for s in full.samples] == [MAX_TOKENS, MAX_TOKENS]
        assert sorted(i for i, _ in ended) == [0, 1]
        assert all(s == full.samples[i] for i, s in ended)
    finally:
        e.close()


def test_a_sample_interrupted_by_a_commit_continues_under_the_new_version(
    endless_server: Server, tmp_path: Path
) -> None:
    """pause("keep") mid-generation, then a whole update (prepare, commit, health) and resume: the sample goes on
    from its tokens so far under the new weights, and its spans say where v1 begins. Greedy decoding makes both parts
    checkable: the tokens before the span are what the old weights give, the tokens after it what the new weights
    give for that prefix (the new policy is an ordinary one, whose end-of-sequence token can be drawn). The request
    is streamed (as for a group that may close early), so the test sees the tokens arriving and pauses mid-sample; a
    plain request is continued the same way (`_GroupRun` does not tell them apart) but shows no progress to pause on:
    the server's counters lag a generation this short."""
    import threading

    import torch

    from rolledger.workers.engines.vllm_engine import VllmEngine
    from rolledger.workers.policy.policy_model import build_model, build_tokenizer, policy_state
    from rolledger.workers.weights.staging_store import DirectoryStagingStore

    e = VllmEngine(endless_server.url, rank=0, model_name=endless_server.model, timeout_s=120.0)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprob_mode="raw")
    try:
        # Every generation compared below computes its prompt from scratch, as the one it is compared with did (the
        # commit drops the prefix cache, so the continuation did): a cached prefix takes another kernel path, and an
        # unscaled random policy's near-tied bfloat16 logits let greedy decoding follow the smallest difference.
        e.reset_prefix_cache()
        before = e.generate(PROMPT, 1, greedy).samples[0]
        assert before.finish_reason == "length"
        v0, d0 = e.policy_version, e.weights_digest()

        streaming = threading.Event()
        polls = 0

        def progress(_: int) -> bool:  # polled at every streamed event; never cancels
            nonlocal polls
            polls += 1
            if polls > 20:
                streaming.set()
            return False

        e.reset_prefix_cache()
        worker, result = generate_in_thread(
            lambda: e.generate(PROMPT, 1, greedy, should_cancel=progress, on_sample=lambda i, s: None)
        )
        assert streaming.wait(timeout=60.0), ("no token streamed", result)
        e.pause("keep")  # the server aborts the request; the sample parks in generate
        v1 = v0 + 1
        tok = build_tokenizer()
        with torch.no_grad():
            new = {k: t.clone() for k, t in policy_state(build_model(_ENDLESS, len(tok), 1)).items()}
        staged = DirectoryStagingStore(tmp_path / "staging").stage(v1, v0, new)
        e.prepare(v1, staged.uri, staged.manifest)
        e.commit_weights(v1)
        assert e.health().ok
        assert worker.is_alive(), result  # still parked: nothing continues before resume
        e.resume()
        worker.join(timeout=120.0)
        assert not worker.is_alive() and len(result) == 1
        out = result[0]
        sample = cast(GroupOutput, out).samples[0]  # an exception here fails the test as it did before
        d1 = e.weights_digest()
        assert len(sample.spans) == 2, sample.spans
        (start0, ver0, dig0), (k, ver1, dig1) = sample.spans
        assert (start0, ver0, dig0) == (0, v0, d0) and (ver1, dig1) == (v1, d1)
        assert 0 < k < MAX_TOKENS
        # the old weights' tokens up to the interruption
        assert sample.token_ids[:k] == before.token_ids[:k], _first_difference(sample.token_ids[:k], before.token_ids)
        e.reset_prefix_cache()
        rest = e.generate([*PROMPT, *sample.token_ids[:k]], 1, greedy.model_copy(update={"max_tokens": MAX_TOKENS - k}))
        # the new weights' continuation of that prefix
        assert sample.token_ids[k:] == rest.samples[0].token_ids, (
            k,
            _first_difference(sample.token_ids[k:], rest.samples[0].token_ids),
        )
        assert sample.finish_reason == rest.samples[0].finish_reason
        assert sample.token_ids[k:] != before.token_ids[k : k + len(sample.token_ids) - k]
        print(f"\ninterrupted at token {k}; continued under v{v1} for {len(sample.token_ids) - k} tokens")
        _serve(e, v1 + 1, endless_server, tmp_path)  # the endless policy again, for the next test
    finally:
        e.close()


def test_a_request_that_reaches_the_server_after_its_pause_is_aborted_by_that_pause(endless_server: Server) -> None:
    """The race of a rollout slot that passed generate's paused check just before a drain paused the engine: its
    request reaches the server after the pause. vLLM queues a request that arrives while paused and would run it at
    resume, on whatever weights serve then, under the version generate stamped before the pause (and the drain would
    wait for it until its deadline). The engine's pause returns only once that request came back aborted, before its
    first token."""
    import threading

    from rolledger.workers.engines.vllm_engine import VllmEngine

    e = VllmEngine(endless_server.url, rank=0, model_name=endless_server.model, timeout_s=120.0)
    try:
        sampling = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=5, logprob_mode="raw")
        sending, server_paused = threading.Event(), threading.Event()
        real_post, real_pause = e.http.post, e._server_pause

        def post(route: str, **kw: object) -> dict[str, object]:
            if route == "/v1/completions" and not server_paused.is_set():
                sending.set()  # past generate's check, about to send: hold it until the server has paused
                assert server_paused.wait(timeout=60.0)
            return real_post(route, **kw)

        def server_pause(mode: str) -> None:
            real_pause(mode)
            server_paused.set()

        e.http.post = post  # type: ignore[method-assign]
        e._server_pause = server_pause  # type: ignore[method-assign]
        slot, result = generate_in_thread(lambda: e.generate(PROMPT, 2, sampling))
        assert sending.wait(timeout=60.0), result
        e.pause("abort")
        # the pause returned: the request has come back (aborted), not left queued in the paused server
        slot.join(timeout=10.0)
        assert not slot.is_alive(), "the request is still waiting in the paused server"
        assert len(result) == 1 and not isinstance(result[0], BaseException), result
        out = result[0]
        assert [s.finish_reason for s in out.samples] == ["abort", "abort"]  # type: ignore[attr-defined]
        assert [len(s.token_ids) for s in out.samples] == [0, 0]  # type: ignore[attr-defined]
        e.resume()
        nothing_left = _metric(e.http.request("GET", "/metrics").text, "vllm:num_requests_waiting")
        assert nothing_left == 0
        short = e.generate(PROMPT, 1, sampling.model_copy(update={"max_tokens": 4}))
        assert [len(s.token_ids) for s in short.samples] == [4]  # the server serves again
    finally:
        e.close()


def _first_difference(a: list[int], b: list[int]) -> str:
    """Where two token lists part (for an assertion's message)."""
    at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"lengths {len(a)} and {len(b)}, first difference at {at}: {a[at : at + 5]} vs {b[at : at + 5]}"


def _serve(e: object, version: int, server: Server, tmp_path: Path) -> None:
    """Put the server's start-up checkpoint back, as `version` (a whole update: pause, prepare, commit, resume)."""
    from safetensors.torch import load_file

    from rolledger.workers.engines.vllm_engine import VllmEngine
    from rolledger.workers.weights.staging_store import DirectoryStagingStore

    assert isinstance(e, VllmEngine)
    state = load_file(str(Path(server.model) / "model.safetensors"))
    staged = DirectoryStagingStore(tmp_path / "restore").stage(version, e.policy_version, state)
    e.pause("wait")
    e.prepare(version, staged.uri, staged.manifest)
    e.commit_weights(version)
    e.resume()
