"""One contract for every engine: the behaviours a rank's engine promises, written once and run against each engine.

As the `eventsourcing` library runs one recorder suite against every backend, a test module subclasses
`EngineContract` and provides a `subject` fixture (a `ContractSubject`: the engine, a way to stage updates it can
read, fresh policy versions, a prompt); pytest then runs every test below against that engine:

- tests/test_engine_contract.py: the torch engine (main suite);
- tests/vllm_tier/test_engine_contract_vllm.py: the vLLM engine on real vLLM CPU servers (vLLM tier);
- tests/sglang_tier/test_engine_contract_sglang.py: the SGLang engine on a real SGLang CPU server (SGLang tier).
- tests/test_engine_contract_fake_vllm.py, tests/test_engine_contract_fake_sglang.py: the vLLM and SGLang clients
  against the FAKE sleep servers of tests/fake_sleep_server.py, the only place their colocated cycle runs on CPU.

Each test leaves the engine as it found it for the next one (serving, resumed, nothing staged), because the server
engines are shared by a whole session; an update moves the engine to a version newer than any used before.

What the contract checks, always from what the engine serves (greedy tokens and logprobs, the digest it measures),
not from what it says: prepare stages into an inactive buffer while the live weights keep serving; a corrupt file
or a shape mismatch is refused naming the tensor; commit swaps the staged version in (its digest is the manifest's)
and invalidates the prefix cache; the logprobs it reports after a commit are what the committed weights give (checked
against torch on the staged tensors); a discarded prepare commits nothing; the health probe is deterministic; illegal
orders are refused; every pause mode stops generation until resume; sleep either works in the legal order or is
refused saying so (GPU-only for the server engines: vLLM and SGLang cannot sleep on CPU); the colocated cycle
(sleep -> wake weights -> prepare -> commit -> wake kv_cache -> health -> generate) completes at every level the
engine sleeps at, and each step out of that order is refused naming it.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from rolledger.schemas.config import ModelConfig, SamplingParams
from rolledger.workers.engines.protocol import (
    Engine,
    EngineError,
    GroupOutput,
    IllegalEngineOrder,
    StaleRequest,
    WeightValidationError,
)
from rolledger.workers.weights.staging_format import StagingError
from rolledger.workers.weights.staging_store import StagedUpdate


def generate_in_thread(call: Callable[[], GroupOutput]) -> tuple[threading.Thread, list[GroupOutput | BaseException]]:
    """Start `call` (an engine.generate, as a rollout slot makes it) on a daemon thread of its own. The list returned
    receives the call's answer, or the exception it raised, for the test to assert on."""
    result: list[GroupOutput | BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprob_mode="raw")
SAMPLED = SamplingParams(temperature=1.0, max_tokens=8, seed=3, logprob_mode="raw")


@dataclass
class ContractSubject:
    """An engine under the contract and what the tests need around it."""

    engine: Engine
    base_state: Callable[[], dict[str, torch.Tensor]]  # HF-named tensors of the checkpoint it started from
    other_state: Callable[[int], dict[str, torch.Tensor]]  # a differently initialised policy of the same shapes
    stage: Callable[[int, Mapping[str, torch.Tensor]], StagedUpdate]  # into a store the engine can read
    prompt: tuple[int, ...] = (1, 4, 5, 14, 6, 15)
    versions: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    # the architecture of base_state and other_state: the contract rebuilds the policy in torch from staged tensors to
    # check what the engine computes with them
    model_config: ModelConfig = field(default_factory=lambda: ModelConfig(dtype="bfloat16"))
    # False for an engine whose logprobs are declared, not computed from its weights (the simulated one)
    computes_logprobs: bool = True

    def next_version(self) -> int:
        """A policy version newer than any this session used (server engines are shared across tests)."""
        v = next(self.versions)
        while v <= self.engine.policy_version:
            v = next(self.versions)
        return v

    def commit(self, state: Mapping[str, torch.Tensor]) -> int:
        """A whole update to `state` at a fresh version (stage, prepare, pause, commit, resume); the version."""
        v = self.next_version()
        staged = self.stage(v, state)
        self.engine.prepare(v, staged.uri, staged.manifest)
        self.engine.pause("wait")
        try:
            self.engine.commit_weights(v)
        finally:
            self.engine.resume()
        return v

    def median_gap(self, state: Mapping[str, torch.Tensor], out: GroupOutput) -> float:
        """The median |logprob under `state` in torch - the logprob the engine reported| over every token of `out`."""
        mine = [x for row in self.torch_logprobs(state, out) for x in row]
        reported = [x for s in out.samples for x in s.logprobs]
        return statistics.median(abs(a - b) for a, b in zip(mine, reported, strict=True))

    def torch_logprobs(self, state: Mapping[str, torch.Tensor], out: GroupOutput) -> list[list[float]]:
        """The logprobs of each sample's tokens under `state`, computed in torch (float32 from the staged tensors)."""
        from rolledger.workers.policy.grpo import sequence_logprobs
        from rolledger.workers.policy.policy_model import build_model

        vocab = int(state["model.embed_tokens.weight"].shape[0])
        model = build_model(self.model_config, vocab, seed=0)
        model.load_state_dict(dict(state), strict=False)
        model.float()
        with torch.no_grad():
            lp, _ = sequence_logprobs(model, [self.prompt] * len(out.samples), [s.token_ids for s in out.samples])
        return [lp[row, : len(s.token_ids)].tolist() for row, s in enumerate(out.samples)]

    def served(self) -> tuple[list[int], list[float]]:
        """What the engine serves: its greedy tokens and logprobs on the prompt."""
        s = self.engine.generate(self.prompt, 1, GREEDY).samples[0]
        return s.token_ids, [round(x, 4) for x in s.logprobs]


def flip_a_byte_of(staged: StagedUpdate, tensor: str) -> None:
    """Corrupt one byte in the middle of `tensor`'s data in the staged safetensors file (its checksum must catch it)."""
    root = Path(staged.uri.removeprefix("file://"))
    for path in sorted(root.glob("*.safetensors")) if root.is_dir() else [root]:
        with open(path, "r+b") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            if tensor not in header:
                continue
            start, end = header[tensor]["data_offsets"]
            at = 8 + n + (start + end) // 2
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x01]))
            return
    raise AssertionError(f"tensor {tensor!r} not found in the staged files at {root}")


class EngineContract:
    """The tests every engine passes; subclass it in a module that defines a `subject` fixture."""

    def test_is_an_engine_whose_specs_are_its_checkpoints(self, subject: ContractSubject) -> None:
        e = subject.engine
        assert isinstance(e, Engine)
        base = subject.base_state()
        specs = e.live_tensor_specs()
        assert set(specs) == set(base)
        for name, t in base.items():
            assert specs[name].shape == tuple(t.shape), name

    def test_generates_a_group_with_token_ids_and_logprobs(self, subject: ContractSubject) -> None:
        e = subject.engine
        vocab = int(subject.base_state()["model.embed_tokens.weight"].shape[0])
        out = e.generate(subject.prompt, 3, SAMPLED)
        assert len(out.samples) == 3
        for s in out.samples:
            assert 1 <= len(s.token_ids) <= SAMPLED.max_tokens
            assert len(s.logprobs) == len(s.token_ids)
            assert all(0 <= t < vocab for t in s.token_ids)
            assert all(math.isfinite(x) and x <= 0.0 for x in s.logprobs)
            assert s.finish_reason in ("stop", "length")
        assert out.policy_version == e.policy_version
        assert out.weights_digest == e.weights_digest()
        assert subject.served() == subject.served()  # greedy is deterministic

    def test_prepare_stages_into_an_inactive_buffer_while_the_live_weights_serve(
        self, subject: ContractSubject
    ) -> None:
        e = subject.engine
        before, digest, version0 = subject.served(), e.weights_digest(), e.policy_version
        v = subject.next_version()
        staged = subject.stage(v, subject.other_state(v))
        try:
            assert e.prepare(v, staged.uri, staged.manifest) == staged.manifest.weights_digest
            assert subject.served() == before
            assert e.weights_digest() == digest
            assert e.policy_version == version0
        finally:
            e.discard_weights()

    def test_a_corrupt_staged_file_is_refused_naming_the_tensor(self, subject: ContractSubject) -> None:
        e = subject.engine
        before, digest = subject.served(), e.weights_digest()
        v = subject.next_version()
        staged = subject.stage(v, subject.other_state(v))
        name = "model.layers.0.mlp.up_proj.weight"
        flip_a_byte_of(staged, name)
        with pytest.raises((EngineError, StagingError)) as info:
            e.prepare(v, staged.uri, staged.manifest)
        assert getattr(info.value, "tensor", None) == name
        assert name in str(info.value)
        with pytest.raises(IllegalEngineOrder):
            e.commit_weights(v)
        assert (subject.served(), e.weights_digest()) == (before, digest)

    def test_a_shape_mismatch_is_refused_naming_the_tensor(self, subject: ContractSubject) -> None:
        e = subject.engine
        before = subject.served()
        v = subject.next_version()
        bad = subject.base_state()
        name = "model.layers.0.mlp.up_proj.weight"
        bad[name] = bad[name][:-1].clone()
        staged = subject.stage(v, bad)
        with pytest.raises(WeightValidationError) as info:
            e.prepare(v, staged.uri, staged.manifest)
        assert info.value.tensor == name
        assert "shape" in info.value.reason
        assert subject.served() == before

    def test_commit_swaps_the_staged_version_in_and_its_digest_is_the_manifests(self, subject: ContractSubject) -> None:
        e = subject.engine
        before = subject.served()
        v = subject.next_version()
        staged = subject.stage(v, subject.other_state(v))
        e.prepare(v, staged.uri, staged.manifest)
        cache_before = e.cache_generation
        e.pause("wait")
        try:
            report = e.commit_weights(v)
            health = e.health()  # a rank probes after its commit, still paused
        finally:
            e.resume()
        assert health.ok, health.detail
        assert report.policy_version == v == e.policy_version
        assert report.weights_digest == staged.manifest.weights_digest == e.weights_digest()
        assert report.cache_generation > cache_before  # what the old weights cached is gone
        out = e.generate(subject.prompt, 1, GREEDY)
        assert (out.policy_version, out.weights_digest) == (v, staged.manifest.weights_digest)
        assert subject.served() != before

    def test_the_logprobs_it_reports_after_a_commit_are_those_of_the_committed_weights(
        self, subject: ContractSubject
    ) -> None:
        """What a sample's logprobs say is what the committed weights give (the trainer's agreement gate relies on
        it): computed again in torch from the staged tensors, they are far closer to the reported ones than what the
        weights served before give. An engine that kept part of the old model (vLLM on CPU kept a tied lm_head's
        kernel packed from its start-up weights) reports a mixture, far from both."""
        if not subject.computes_logprobs:
            pytest.skip("this engine declares its logprobs instead of computing them from its weights")
        states = [subject.other_state(1000), subject.other_state(1001)]
        for state in states:  # two commits: the weights served before this sample are known
            subject.commit(state)
        out = subject.engine.generate(subject.prompt, 4, SAMPLED)
        before, committed = subject.median_gap(states[0], out), subject.median_gap(states[1], out)
        print(f"\nmedian logprob gap: to the committed weights {committed:.2e}, to the weights before {before:.2e}")
        assert committed * 10 < before, (committed, before)

    def test_a_request_expecting_a_version_no_longer_served_is_refused(self, subject: ContractSubject) -> None:
        """The rollout logs a group's samples as started on the version it read, then sends the request; a whole
        update can commit in between. The engine refuses such a request (StaleRequest, an IllegalEngineOrder) rather
        than run it on weights its stamp does not name; one expecting what serves runs as any other."""
        e = subject.engine
        old = e.policy_version
        assert e.generate(subject.prompt, 1, GREEDY, expect_version=old).samples
        subject.commit(subject.other_state(1002))
        assert e.policy_version != old
        with pytest.raises(StaleRequest, match=f"expects v{old}"):
            e.generate(subject.prompt, 1, GREEDY, expect_version=old)
        out = e.generate(subject.prompt, 1, GREEDY, expect_version=e.policy_version)
        assert out.policy_version == e.policy_version and len(out.samples) == 1

    def test_a_discarded_prepare_commits_nothing(self, subject: ContractSubject) -> None:
        e = subject.engine
        before, digest, version0 = subject.served(), e.weights_digest(), e.policy_version
        v = subject.next_version()
        staged = subject.stage(v, subject.other_state(v))
        e.prepare(v, staged.uri, staged.manifest)
        e.discard_weights()
        with pytest.raises(IllegalEngineOrder):
            e.commit_weights(v)
        assert (subject.served(), e.weights_digest(), e.policy_version) == (before, digest, version0)

    def test_the_health_probe_is_deterministic(self, subject: ContractSubject) -> None:
        first, second = subject.engine.health(), subject.engine.health()
        assert first.ok and second.ok, (first.detail, second.detail)
        assert first.probe_digest and first.probe_digest == second.probe_digest

    def test_reset_prefix_cache_bumps_the_generation(self, subject: ContractSubject) -> None:
        e = subject.engine
        g0 = e.generate(subject.prompt, 1, GREEDY).cache_generation
        assert e.reset_prefix_cache() == g0 + 1
        assert e.generate(subject.prompt, 1, GREEDY).cache_generation == g0 + 1 == e.cache_generation

    def test_illegal_orders_are_refused(self, subject: ContractSubject) -> None:
        e = subject.engine
        v = subject.next_version()
        with pytest.raises(IllegalEngineOrder):
            e.commit_weights(v)  # nothing staged
        staged = subject.stage(v, subject.other_state(v))
        e.prepare(v, staged.uri, staged.manifest)
        try:
            with pytest.raises(IllegalEngineOrder):
                e.commit_weights(v + 1)  # not the staged version
        finally:
            e.discard_weights()
        assert e.policy_version < v

    @pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
    def test_every_pause_mode_stops_generation_until_resume(self, subject: ContractSubject, mode: str) -> None:
        e = subject.engine
        e.pause(mode)  # type: ignore[arg-type]  # the PauseMode literals, parametrized
        try:
            assert e.is_paused is True
            with pytest.raises(IllegalEngineOrder, match="paused"):
                e.generate(subject.prompt, 1, GREEDY)
        finally:
            e.resume()
        assert e.is_paused is False
        assert len(e.generate(subject.prompt, 1, GREEDY).samples) == 1

    def test_an_unknown_pause_mode_is_refused(self, subject: ContractSubject) -> None:
        with pytest.raises(ValueError, match="pause mode"):
            subject.engine.pause("later")  # type: ignore[arg-type]  # deliberately not a PauseMode
        assert subject.engine.is_paused is False

    def test_sleep_works_in_the_legal_order_or_is_refused_saying_so(self, subject: ContractSubject) -> None:
        e = subject.engine
        if not e.capabilities.sleep_levels:  # vLLM and SGLang on CPU: sleep is GPU-only
            with pytest.raises(EngineError, match="unavailable"):
                e.sleep(1)
            with pytest.raises(EngineError, match="unavailable"):
                e.wake(["weights"])
            assert e.asleep_level == 0
            return
        before, digest = subject.served(), e.weights_digest()
        v = subject.next_version()
        staged = subject.stage(v, subject.other_state(v))
        e.pause("wait")
        try:
            e.sleep(1)
            assert e.asleep_level == 1
            with pytest.raises(IllegalEngineOrder):
                e.prepare(v, staged.uri, staged.manifest)  # never update while asleep
            e.wake(["weights", "kv_cache"])
        finally:
            e.resume()
        assert e.asleep_level == 0
        assert (subject.served(), e.weights_digest()) == (before, digest)

    def _sleepable(self, subject: ContractSubject, level: int) -> Engine:
        e = subject.engine
        if level not in e.capabilities.sleep_levels:
            pytest.skip(f"{e.capabilities.name} cannot sleep at level {level} here ({e.capabilities.sleep_levels})")
        return e

    @staticmethod
    def _wake_and_resume(e: Engine) -> None:
        """After a colocated test, pass or fail: leave the engine awake, nothing staged, resumed."""
        if e.asleep_level:
            e.wake(["weights", "kv_cache"])
        e.discard_weights()
        e.resume()

    @pytest.mark.parametrize("level", [1, 2])
    def test_the_colocated_cycle_wakes_the_weights_for_the_update_and_the_kv_cache_after(
        self, subject: ContractSubject, level: int
    ) -> None:
        """sleep(level) -> wake(weights) -> prepare -> commit -> wake(kv_cache) -> health -> generate, as a colocated
        rank runs it (vLLM's documented RL order): "weights awake, KV cache asleep" is where the update is made."""
        e = self._sleepable(subject, level)
        v = subject.next_version()
        staged = subject.stage(v, subject.other_state(v))
        e.pause("wait")
        try:
            e.sleep(level)
            assert e.asleep_level == level
            e.wake(["weights"])
            assert e.asleep_level == level  # the KV cache still sleeps
            e.prepare(v, staged.uri, staged.manifest)  # weights awake, KV asleep: legal
            report = e.commit_weights(v)
            e.wake(["kv_cache"])
            assert e.asleep_level == 0
            health = e.health()
        finally:
            self._wake_and_resume(e)
        assert health.ok, health.detail
        assert report.policy_version == v == e.policy_version
        assert report.weights_digest == staged.manifest.weights_digest == e.weights_digest()
        out = e.generate(subject.prompt, 1, GREEDY)
        assert (out.policy_version, out.weights_digest) == (v, staged.manifest.weights_digest)

    @pytest.mark.parametrize("level", [1, 2])
    def test_each_illegal_colocated_order_is_refused_naming_the_order(
        self, subject: ContractSubject, level: int
    ) -> None:
        """On the way through the cycle every step out of order is refused (IllegalEngineOrder naming what to do
        first), and the refusals leave the state as it was: the legal order still completes afterwards."""
        e = self._sleepable(subject, level)
        v = subject.next_version()
        staged = subject.stage(v, subject.other_state(v))
        e.pause("wait")
        try:
            e.sleep(level)
            with pytest.raises(IllegalEngineOrder, match="already asleep"):
                e.sleep(level)
            with pytest.raises(IllegalEngineOrder, match=r"wake\(\['weights'\]\) first"):
                e.prepare(v, staged.uri, staged.manifest)  # never send weights while they sleep
            with pytest.raises(IllegalEngineOrder, match=r"wake\(\['weights'\]\) first"):
                e.commit_weights(v)
            with pytest.raises(IllegalEngineOrder, match=r"kv_cache.*before.*weights"):
                e.wake(["kv_cache"])
            with pytest.raises(IllegalEngineOrder):
                e.generate(subject.prompt, 1, GREEDY)
            e.wake(["weights"])
            with pytest.raises(IllegalEngineOrder):
                e.generate(subject.prompt, 1, GREEDY)  # the KV cache still sleeps
            assert not e.health().ok  # no probe before the KV cache is back
            with pytest.raises(IllegalEngineOrder, match="already asleep"):
                e.sleep(level)
            e.prepare(v, staged.uri, staged.manifest)
            e.commit_weights(v)
            e.wake(["kv_cache"])
            assert e.asleep_level == 0
        finally:
            self._wake_and_resume(e)
        assert e.policy_version == v
        assert e.generate(subject.prompt, 1, GREEDY).policy_version == v
