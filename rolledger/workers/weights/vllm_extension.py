"""rolledger's vLLM worker extension: a fail-closed prepare/commit/rollback of weights inside each vLLM worker.

Loaded with `--worker-extension-cls workers.weights.vllm_extension.RolledgerWorkerExtension`; vLLM mixes the class into
every worker, and `POST /collective_rpc {"method": "rolledger_...", "args": [...]}` calls a method on each worker,
returning one result per worker. Every method answers with a plain dict (`ok`, `rank`, ...) instead of raising,
so each worker reports for itself and one failing worker does not hide what the others did.

What it owns:
- `rolledger_prepare(version, uri, manifest_json)`: read the staged tensors (workers.weights.staging_loader.load_verified, which
  checks every checksum against the manifest) into a host buffer held here, and check the names/shapes/dtypes against the
  tensors vLLM loaded at start-up and against the live model's parameters (names mapped through the model's
  `packed_modules_mapping`, e.g. q_proj -> qkv_proj). The live weights keep serving.
- `rolledger_commit(version)`: keep the current HF-named tensors for rollback, `model_runner.reload_weights(
  weights_iterator=...)` from the buffer, verify the live digest afterwards. On any error, reload the retained
  tensors, verify that the live digest is back to what it was, and report the failure.
  (Never `model.load_weights` after start-up: on CPU it fails half way and leaves a corrupt mixture.)
- `rolledger_discard()`, `rolledger_rollback()` (back to the version before the last commit),
  `rolledger_digest()`, `rolledger_live_digest()`, `rolledger_specs()`, `rolledger_inject(spec)` (test faults).

Two digests, on purpose:
- *weights digest* (`rolledger_digest`): workers.weights.tensors.state_digest of the HF-named tensors last loaded
  successfully. It equals the trainer's state_digest and the manifest's weights_digest. vLLM's own parameters cannot
  give it: names differ (qkv_proj) and CPU linear layers are repacked into kernels (their `weight` is emptied).
- *live digest* (`rolledger_live_digest`): a digest of what actually serves: every non-empty live parameter and
  buffer, plus the output of every linear layer on a fixed probe input (which reads the repacked kernels). It is
  only comparable within one server process; it is used to prove that a commit changed the weights and that a
  rollback restored exactly the previous state.

Memory: the extension holds the live HF-named tensors, the previous version's (for rollback) and a staged buffer,
all in host memory: up to three copies of the model. Fine for this project's models; document it for large ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rolledger.schemas.weights import CHECKSUM_ALGO, digest_entries
from rolledger.workers.weights.tensors import dtype_name, state_digest, tensor_checksum

Result = dict[str, Any]

FAULTS = ("fail-prepare", "corrupt-prepare", "fail-commit", "stale-commit")


@dataclass
class _Buffer:
    """An HF-named state dict with its digest and the policy version it belongs to."""

    version: int
    tensors: dict[str, torch.Tensor]
    digest: str


@dataclass
class _State:
    """Everything the extension keeps per worker (vLLM mixes the class in without calling an __init__)."""

    live: _Buffer | None = None  # what is serving (HF names); None until the start-up checkpoint is read
    previous: _Buffer | None = None  # what served before the last commit
    staged: _Buffer | None = None
    faults: set[str] = field(default_factory=set)
    live_digest_by_weights: dict[str, str] = field(default_factory=dict)  # weights digest -> observed live digest
    initialised: bool = False
    init_error: str = ""


class _PrepareError(Exception):
    def __init__(self, tensor: str, reason: str) -> None:
        super().__init__(f"tensor {tensor!r}: {reason}")
        self.tensor = tensor
        self.reason = reason


class TiedHeadDiffers(ValueError):
    """An update's lm_head.weight differs from its embedding on a model that ties them (vLLM would ignore it)."""

    def __init__(self) -> None:
        self.tensor = "lm_head.weight"
        self.reason = "differs from the tied model.embed_tokens.weight"
        super().__init__(f"tensor {self.tensor!r}: {self.reason}")


def _is_embedding_method(quant_method: object) -> bool:
    """Is this vLLM's method of an unquantized embedding layer (the input embedding, or an lm_head, tied or not)?
    By name: this module is imported where vLLM is not installed."""
    return type(quant_method).__name__ == "UnquantizedEmbeddingMethod"


def reprocess_embeddings(model: torch.nn.Module) -> None:
    """Call after every in-place reload of a vLLM model (`reload_weights`, by this extension's commit or by vLLM's
    own update routes through workers.weights.vllm_transfer_engine).

    vLLM's in-place reload processes a layer's weights again (on CPU: repacks its GEMM kernel) only when it loaded
    weights into that layer. A tied lm_head loads none (its weight is the input embedding's), so on CPU it kept the
    kernel packed from the start-up weights and computed every logit with them, while each digest named the new
    version (measured on vLLM CPU 0.32, the loop tier's tied float32 Llama updated to unrelated weights: served
    logprobs off the new weights' by a median 0.23; the trainer's agreement gate refused a run's v2 at 0.0026). Every
    embedding layer is processed again from the weight it holds now (a no-op off CPU, where the lm_head multiplies by
    its weight directly)."""
    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if qm is not None and _is_embedding_method(qm) and isinstance(weight, torch.Tensor) and weight.numel() > 0:
            qm.process_weights_after_loading(module)


def ties_embeddings(hf_config: Any) -> bool:
    """Does the model (its text part, for a multimodal config) tie lm_head to the input embedding?"""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return bool(getattr(text, "tie_word_embeddings", False))


def drop_tied_head(tensors: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """With tied embeddings vLLM has no lm_head parameter of its own and ignores lm_head.weight: drop it from
    `tensors` (in place), and raise TiedHeadDiffers instead when it is not the embedding's copy, since the update
    would then serve other weights than its manifest says."""
    if "lm_head.weight" in tensors and ties_embeddings(hf_config):
        head = tensors.pop("lm_head.weight")
        emb = tensors.get("model.embed_tokens.weight")
        if emb is not None and tensor_checksum(head) != tensor_checksum(emb):
            raise TiedHeadDiffers()
    return tensors


def _finite(t: torch.Tensor) -> bool:
    if not t.is_floating_point() or t.numel() == 0:
        return True
    return bool(torch.isfinite(t).all().item())


class RolledgerWorkerExtension:
    """Mixed into vLLM's worker class; every public method is reachable through /collective_rpc."""

    # Provided by the vLLM worker this class is mixed into (annotations only: no class attribute shadows them).
    model_runner: Any
    vllm_config: Any

    # -- plumbing -----------------------------------------------------------------------------------------------

    def _rolledger_state(self) -> _State:
        st: _State | None = getattr(self, "_rolledger_st", None)
        if st is None:
            st = _State()
            self._rolledger_st = st
        if not st.initialised:
            st.initialised = True
            try:
                tensors = self._rolledger_read_checkpoint()
                st.live = _Buffer(version=0, tensors=tensors, digest=state_digest(tensors))
            except Exception as e:  # noqa: BLE001 - reported on every answer, never swallowed silently
                st.init_error = f"start-up weights unavailable: {e}"
        return st

    def _rolledger_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def _rolledger_model(self) -> torch.nn.Module:
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _rolledger_answer(self, ok: bool, **fields: Any) -> Result:
        st = self._rolledger_state()
        out: Result = {
            "ok": ok,
            "rank": self._rolledger_rank(),
            "version": st.live.version if st.live else None,
            "digest": st.live.digest if st.live else "",
            "staged_version": st.staged.version if st.staged else None,
        }
        if st.init_error:
            out["init_error"] = st.init_error
        out.update(fields)
        return out

    def _rolledger_read_checkpoint(self) -> dict[str, torch.Tensor]:
        """The HF-named tensors vLLM loaded at start-up, read from the model directory's safetensors files."""
        from safetensors.torch import load_file

        model_dir = Path(str(self.vllm_config.model_config.model))
        files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
        if not files:
            raise FileNotFoundError(f"no *.safetensors in model directory {model_dir}")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f), device="cpu"))
        return self._rolledger_drop_tied(tensors)

    def _rolledger_drop_tied(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`drop_tied_head` for this worker's model, its refusal as a prepare error naming the tensor."""
        try:
            return drop_tied_head(tensors, self.vllm_config.model_config.hf_config)
        except TiedHeadDiffers as e:
            raise _PrepareError(e.tensor, e.reason) from e

    def _rolledger_live_names(self) -> dict[str, torch.Tensor]:
        model = self._rolledger_model()
        return dict(model.named_parameters(remove_duplicate=False))

    def _rolledger_live_name(self, hf_name: str) -> str:
        """The vLLM parameter an HF-named tensor loads into (packed modules: q_proj -> qkv_proj, ...)."""
        packed: Mapping[str, list[str]] = getattr(self._rolledger_model(), "packed_modules_mapping", {}) or {}
        parts = hf_name.split(".")
        for target, sources in packed.items():
            for src in sources:
                if src in parts:
                    return ".".join(target if p == src else p for p in parts)
        return hf_name

    def _rolledger_reload(self, tensors: Mapping[str, torch.Tensor]) -> None:
        def items() -> Iterator[tuple[str, torch.Tensor]]:
            yield from tensors.items()

        self.model_runner.reload_weights(weights_iterator=items())
        reprocess_embeddings(self._rolledger_model())

    # -- digests ------------------------------------------------------------------------------------------------

    def _rolledger_compute_live_digest(self) -> tuple[str, str]:
        """(digest, problem): digest of live params/buffers and of each linear layer's output on a fixed probe."""
        model = self._rolledger_model()
        entries: list[tuple[str, str, tuple[int, ...], str]] = []
        problem = ""
        with torch.inference_mode():
            for name, p in model.named_parameters():
                if p.numel() == 0:
                    continue
                if not problem and not _finite(p.data):
                    problem = f"live parameter {name!r} holds NaN/inf"
                entries.append((name, dtype_name(p.dtype), tuple(p.shape), tensor_checksum(p.data)))
            for name, b in model.named_buffers():
                if b.numel() == 0:
                    continue
                entries.append((f"buffer:{name}", dtype_name(b.dtype), tuple(b.shape), tensor_checksum(b)))
            for name, module in model.named_modules():
                qm = getattr(module, "quant_method", None)
                in_size = getattr(module, "input_size_per_partition", None)
                if in_size is None and _is_embedding_method(qm):  # an lm_head: its logits kernel, as it serves
                    in_size = getattr(module, "embedding_dim", None)
                if qm is None or in_size is None or not hasattr(qm, "apply"):
                    continue
                dtype = getattr(module, "params_dtype", torch.float32)
                device = next((p.device for p in module.parameters()), torch.device("cpu"))
                x = torch.sin(torch.arange(2 * int(in_size), dtype=torch.float32) * 0.37).reshape(2, int(in_size))
                out = qm.apply(module, x.to(dtype=dtype, device=device), None)
                if isinstance(out, tuple):
                    out = out[0]
                if not problem and not _finite(out):
                    problem = f"live layer {name!r} produces NaN/inf"
                entries.append((f"probe:{name}", dtype_name(out.dtype), tuple(out.shape), tensor_checksum(out)))
        return digest_entries(entries), problem

    # -- the RPC surface ----------------------------------------------------------------------------------------

    def rolledger_inject(self, spec: str) -> Result:
        """Arm a one-shot fault: fail-prepare | corrupt-prepare | fail-commit | stale-commit | clear."""
        st = self._rolledger_state()
        if spec == "clear":
            st.faults.clear()
        elif spec in FAULTS:
            st.faults.add(spec)
        else:
            return self._rolledger_answer(False, error=f"unknown fault {spec!r}; expected one of {FAULTS} or 'clear'")
        return self._rolledger_answer(True, armed=sorted(st.faults))

    def rolledger_specs(self) -> Result:
        """Name -> [shape, dtype] of the HF-named tensors now serving (what staged tensors must match)."""
        st = self._rolledger_state()
        if st.live is None:
            return self._rolledger_answer(False, error=st.init_error)
        specs = {n: [list(t.shape), dtype_name(t.dtype)] for n, t in st.live.tensors.items()}
        return self._rolledger_answer(True, specs=specs)

    def rolledger_digest(self) -> Result:
        st = self._rolledger_state()
        return self._rolledger_answer(st.live is not None, error=st.init_error or None)

    def rolledger_live_digest(self) -> Result:
        digest, problem = self._rolledger_compute_live_digest()
        return self._rolledger_answer(not problem, live_digest=digest, error=problem or None)

    def rolledger_prepare(self, version: int, uri: str, manifest_json: str) -> Result:
        """Read and validate version `version` from `uri` into the staged buffer; live weights are untouched."""
        st = self._rolledger_state()
        st.staged = None
        try:
            buf = self._rolledger_prepare(st, int(version), str(uri), manifest_json)
        except _PrepareError as e:
            return self._rolledger_answer(False, stage="prepare", tensor=e.tensor, reason=e.reason, error=str(e))
        except Exception as e:  # noqa: BLE001 - every failure is reported to the coordinator, with its type
            return self._rolledger_answer(False, stage="prepare", tensor=None, error=f"{type(e).__name__}: {e}")
        st.staged = buf
        return self._rolledger_answer(True, stage="prepare", staged_digest=buf.digest)

    def _rolledger_prepare(self, st: _State, version: int, uri: str, manifest_json: str) -> _Buffer:
        from rolledger.schemas.weights import WeightManifest
        from rolledger.workers.weights.staging_format import StagingError
        from rolledger.workers.weights.transport import load_verified

        if st.live is None:
            raise _PrepareError("*", st.init_error or "no live weights known")
        manifest = WeightManifest.model_validate_json(manifest_json)
        if manifest.version != version:
            raise _PrepareError("*", f"manifest is for version {manifest.version}, asked to prepare {version}")
        if version <= st.live.version:
            raise _PrepareError("*", f"version {version} is not newer than the live version {st.live.version}")
        if "fail-prepare" in st.faults:
            st.faults.discard("fail-prepare")
            raise _PrepareError("*", "injected prepare failure (fail-prepare)")
        corrupt = None
        if "corrupt-prepare" in st.faults:  # a bad transfer: one byte flipped after reading, checksum must catch it
            st.faults.discard("corrupt-prepare")
            corrupt = next(e.name for e in manifest.tensors if e.nbytes > 0)
        try:
            # pread into private host memory; every tensor's presence, dtype, shape and checksum checked
            verified = load_verified(uri, version, manifest, corrupt=corrupt)
        except StagingError as e:
            raise _PrepareError(e.tensor or "*", f"{e.kind}: {e.reason}") from e
        tensors = self._rolledger_drop_tied(dict(verified.tensors))
        self._rolledger_validate_against_live(st.live.tensors, tensors)
        for name, t in tensors.items():
            if not _finite(t):
                raise _PrepareError(name, "holds NaN/inf")
        if manifest.checksum_algo == CHECKSUM_ALGO:  # checksums already verified: the digest needs no re-hash
            digest = digest_entries(e.as_digest_entry() for e in manifest.tensors if e.name in tensors)
        else:
            digest = state_digest(tensors)
        return _Buffer(version=version, tensors=tensors, digest=digest)

    def _rolledger_validate_against_live(
        self, reference: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]
    ) -> None:
        """Same names/shapes/dtypes as what serves, and every name lands in a live vLLM parameter."""
        missing = sorted(set(reference) - set(tensors))
        if missing:
            raise _PrepareError(missing[0], "served by the live model but missing from the update")
        live = self._rolledger_live_names()
        for name in sorted(tensors):
            t = tensors[name]
            ref = reference.get(name)
            if ref is None:
                raise _PrepareError(name, "not a tensor of the live model")
            if tuple(t.shape) != tuple(ref.shape):
                raise _PrepareError(name, f"shape {tuple(t.shape)} != live {tuple(ref.shape)}")
            if t.dtype != ref.dtype:
                raise _PrepareError(name, f"dtype {dtype_name(t.dtype)} != live {dtype_name(ref.dtype)}")
            live_name = self._rolledger_live_name(name)
            param = live.get(live_name)
            if param is None:
                raise _PrepareError(name, f"maps to vLLM parameter {live_name!r}, which the live model lacks")
            # vLLM may pad a parameter (vocab rows of embeddings), and CPU linears are repacked to an empty weight
            if (
                live_name == name
                and param.numel() > 0
                and (param.dim() != t.dim() or any(a > b for a, b in zip(t.shape, param.shape, strict=True)))
            ):
                raise _PrepareError(
                    name, f"shape {tuple(t.shape)} does not fit live vLLM parameter {tuple(param.shape)}"
                )

    def rolledger_commit(self, version: int) -> Result:
        """Swap the staged buffer in; on any failure restore the previous weights and report it."""
        st = self._rolledger_state()
        version = int(version)
        if st.staged is None or st.staged.version != version:
            have = st.staged.version if st.staged else None
            return self._rolledger_answer(
                False, stage="commit", error=f"nothing staged for version {version} (staged: {have})"
            )
        if st.live is None:
            return self._rolledger_answer(False, stage="commit", error=st.init_error)
        old, new = st.live, st.staged
        before, problem = self._rolledger_compute_live_digest()
        if problem:
            return self._rolledger_answer(
                False, stage="commit", error=f"refusing to commit over a bad model: {problem}"
            )
        st.live_digest_by_weights.setdefault(old.digest, before)
        try:
            if "stale-commit" in st.faults:
                st.faults.discard("stale-commit")  # rank silently keeps the old weights: verification must catch it
            else:
                self._rolledger_reload(new.tensors)
            if "fail-commit" in st.faults:
                st.faults.discard("fail-commit")
                raise RuntimeError("injected commit failure after the reload (fail-commit)")
            after, problem = self._rolledger_compute_live_digest()
            if problem:
                raise RuntimeError(problem)
            if new.digest != old.digest and after == before:
                raise RuntimeError("live weights did not change after the reload")
            known = st.live_digest_by_weights.get(new.digest)
            if known is not None and known != after:
                raise RuntimeError(f"live digest {after} differs from the one seen before for these weights ({known})")
        except Exception as e:  # noqa: BLE001 - roll back on anything, then report
            restored = self._rolledger_restore(old, before)
            return self._rolledger_answer(
                False,
                stage="commit",
                error=f"{type(e).__name__}: {e}",
                rolled_back=restored == "",
                rollback_error=restored or None,
            )
        st.live_digest_by_weights[new.digest] = after
        st.previous, st.live, st.staged = old, new, None
        return self._rolledger_answer(True, stage="commit", live_digest=after)

    def _rolledger_restore(self, buf: _Buffer, expected_live: str) -> str:
        """Reload `buf`; return '' when the live digest is back to `expected_live`, else what went wrong."""
        try:
            self._rolledger_reload(buf.tensors)
        except Exception as e:  # noqa: BLE001
            return f"rollback reload failed: {type(e).__name__}: {e}"
        got, problem = self._rolledger_compute_live_digest()
        if problem:
            return f"rollback left a bad model: {problem}"
        if got != expected_live:
            return f"rollback left live digest {got}, expected {expected_live}"
        return ""

    def rolledger_discard(self) -> Result:
        st = self._rolledger_state()
        had = st.staged.version if st.staged else None
        st.staged = None
        return self._rolledger_answer(True, discarded=had)

    def rolledger_rollback(self) -> Result:
        """Back to the version that served before the last commit (one step; the staged buffer is dropped)."""
        st = self._rolledger_state()
        if st.previous is None or st.live is None:
            return self._rolledger_answer(False, stage="rollback", error="no previous version to roll back to")
        prev, cur = st.previous, st.live
        expected = st.live_digest_by_weights[prev.digest]  # recorded by the commit that replaced it
        current_live, _ = self._rolledger_compute_live_digest()
        problem = self._rolledger_restore(prev, expected)
        if problem:
            # try to get back to what was serving, so the rank is at least consistent
            back = self._rolledger_restore(cur, current_live)
            return self._rolledger_answer(False, stage="rollback", error=problem, restored_current=back == "")
        st.live, st.previous, st.staged = prev, None, None
        return self._rolledger_answer(True, stage="rollback")


__all__ = ["FAULTS", "RolledgerWorkerExtension"]
