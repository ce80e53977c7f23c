"""An SGLang rank's weight update, as a transaction (`SglangUpdate`, a part of
workers.engines.sglang_engine.SglangEngine). prepare: read the staged update through the verified path, check it
against the serving model (workers.engines.torch_weights) and write it as a checkpoint directory SGLang can load
(workers.engines.sglang_weights); the live weights keep serving. commit: `/update_weights_from_disk` with that
directory, then the live weights are read back (`/weights_checker` checksums, which must equal the update's); a
failed or unverified load is undone by loading and verifying what served before. rollback goes back one version the
same way; the weights digest is measured from the server's checksums.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rolledger.schemas.weights import WeightManifest
from rolledger.workers.engines import torch_weights
from rolledger.workers.engines.protocol import (
    CommitReport,
    EngineError,
    IllegalEngineOrder,
    TensorSpec,
    WeightValidationError,
)
from rolledger.workers.engines.sglang_state import Loaded, SglangRankState
from rolledger.workers.engines.sglang_weights import differing, expected_checksums, write_checkpoint
from rolledger.workers.engines.vllm_http import JsonHttp
from rolledger.workers.weights.tensors import state_digest
from rolledger.workers.weights.transport import DeltaBase, load_verified
from rolledger.workers.weights.vllm_extension import TiedHeadDiffers, drop_tied_head


class SglangUpdate:
    """The weights of an SGLang rank (a mixin of SglangEngine, which sets the attributes below)."""

    rank: int
    http: JsonHttp
    hf_config: Any
    model_dir: Path
    staging_dir: Path
    _specs: dict[str, TensorSpec]
    _st: SglangRankState
    _cond: threading.Condition

    def _loaded(self, version: int, directory: Path, tensors: dict[str, torch.Tensor]) -> Loaded:
        return Loaded(version, directory, tensors, state_digest(tensors), expected_checksums(tensors))

    def live_tensor_specs(self) -> Mapping[str, TensorSpec]:
        return dict(self._specs)

    def live_checksums(self) -> dict[str, str]:
        """What SGLang reports for every live parameter (`/weights_checker` checksum, one TP rank)."""
        body = self.http.post("/weights_checker", json={"action": "checksum"})
        ranks = body.get("ranks")
        if not isinstance(ranks, list) or len(ranks) != 1:
            raise EngineError(f"rank {self.rank}: SGLang /weights_checker: expected one TP rank, got {ranks!r:.200}")
        return {str(k): str(v) for k, v in (ranks[0].get("checksums") or {}).items()}

    def _verify_live(self, want: Loaded) -> None:
        bad = differing(want.checksums, self.live_checksums())
        if bad:
            param, names, what = bad[0]
            tensor = names[0] if names else param
            raise WeightValidationError(
                tensor, f"v{want.version} not live on SGLang rank {self.rank}: {param} {what} ({len(bad)} differ)"
            )

    def prepare(self, version: int, uri: str, manifest: WeightManifest) -> str:
        """Read and verify the staged update, validate it against the serving model, write its checkpoint directory;
        return its digest. The live weights keep serving."""
        self._check_awake(f"prepare v{version}")
        live = self._st.live
        tensors = dict(load_verified(uri, version, manifest, base=DeltaBase(live.version, live.tensors)))
        return self.stage_weights(version, tensors)

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> str:
        self._check_awake(f"stage v{version}")
        tensors = dict(tensors)
        try:
            drop_tied_head(tensors, self.hf_config)
        except TiedHeadDiffers as e:
            raise WeightValidationError(e.tensor, e.reason) from None
        torch_weights.validate_update(self._specs, tensors)
        live = self._st.live
        full = {n: tensors.get(n, live.tensors[n]) for n in self._specs}  # an update of some tensors keeps the rest
        with self._cond:
            self._st.staged = None
        directory = write_checkpoint(self.staging_dir / f"v{version}", full, self.model_dir)
        staged = self._loaded(version, directory, full)
        with self._cond:
            self._st.staged = staged
        return staged.digest

    def _check_awake(self, what: str) -> None:
        self._st.sleep.check_weights_awake(what, self.rank)

    def _load(self, target: Loaded) -> None:
        """Make the server serve `target` (verified); on failure load and verify what served before, then raise."""
        before = self._st.live
        body: dict[str, Any] = {
            "model_path": str(target.directory),
            "weight_version": str(target.version),
            "flush_cache": True,
            "abort_all_requests": False,
            "keep_pause": self._st.paused,
        }
        try:
            resp = self.http.request("POST", "/update_weights_from_disk", json=body)
            if not resp.json().get("success"):
                raise EngineError(f"rank {self.rank}: SGLang /update_weights_from_disk: {resp.json()!r:.300}")
            self._verify_live(target)
        except EngineError as failure:
            self._restore(before, failure)
            raise
        with self._cond:
            self._st.cache_generation += 1  # flush_cache=True: the update succeeds only if the cache was flushed
        self._set_label(target.version)

    def _restore(self, before: Loaded, failure: EngineError) -> None:
        try:
            self.http.post(
                "/update_weights_from_disk",
                json={
                    "model_path": str(before.directory),
                    "weight_version": str(before.version),
                    "flush_cache": True,
                    "keep_pause": self._st.paused,
                },
            )
            self._verify_live(before)
        except EngineError as e:
            raise EngineError(
                f"rank {self.rank}: {failure}; restoring v{before.version} failed too ({e}): the server's weights are "
                "unknown, restart it"
            ) from failure
        self._set_label(before.version)

    def _set_label(self, version: int) -> None:
        got = self.http.get("/model_info").get("weight_version")
        if got != str(version):
            self.http.post("/update_weight_version", json={"new_version": str(version), "abort_all_requests": False})

    def commit_weights(self, version: int) -> CommitReport:
        self._check_awake(f"commit v{version}")
        with self._cond:
            staged = self._st.staged
            if staged is None or staged.version != version:
                raise IllegalEngineOrder(
                    f"rank {self.rank}: commit of version {version} but staged is "
                    f"{None if staged is None else staged.version}"
                )
            self._st.staged = None
        self._load(staged)
        old = self._st.live
        with self._cond:
            self._st.previous, self._st.live = old, staged
            self._st.sleep = self._st.sleep.committed()
        self._collect()
        return CommitReport(version, staged.digest, self._st.cache_generation, 0, False)

    def rollback_weights(self) -> CommitReport:
        """Back to the version before the last commit (loaded and verified), label and prefix cache following."""
        self._check_awake("rollback")
        previous = self._st.previous
        if previous is None:
            raise IllegalEngineOrder(f"rank {self.rank}: rollback with no earlier version loaded")
        self._load(previous)
        with self._cond:
            self._st.previous, self._st.live = None, previous
            self._st.sleep = self._st.sleep.committed()
        return CommitReport(previous.version, previous.digest, self._st.cache_generation, 0, False)

    def _collect(self) -> None:
        """Delete prepared directories that are neither live, previous nor staged (never the model directory)."""
        keep = {x.directory for x in (self._st.live, self._st.previous, self._st.staged) if x is not None}
        for d in self.staging_dir.glob("v*"):
            if d.is_dir() and d not in keep:
                shutil.rmtree(d, ignore_errors=True)

    def discard_weights(self) -> None:
        with self._cond:
            staged, self._st.staged = self._st.staged, None
        if staged is not None and staged.directory != self.model_dir:
            shutil.rmtree(staged.directory, ignore_errors=True)

    @property
    def staged_version(self) -> int | None:
        staged = self._st.staged
        return None if staged is None else staged.version

    def weights_digest(self) -> str:
        """The digest of the version the server's live checksums match (live, or a previous one), measured."""
        live = self.live_checksums()
        for candidate in (self._st.live, self._st.previous):
            if candidate is not None and not differing(candidate.checksums, live):
                return candidate.digest
        raise EngineError(f"rank {self.rank}: the SGLang server's live weights match no version this rank loaded")
