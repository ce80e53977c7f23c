"""A vLLM rank's weight update (`VllmUpdate`, a part of workers.engines.vllm_engine.VllmEngine), over
`/collective_rpc` on every worker of the server (workers.weights.vllm_extension): prepare makes each worker read and
validate the staged update into its own host buffer, commit swaps it in (rolled back by the worker on failure), then
the version label is set and checked and the prefix cache reset; rollback, discard, the digests (staged, served,
live) and one-shot fault injection. A worker answering `ok: false` is an EngineError (or a WeightValidationError
naming the tensor).
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from rolledger.schemas.weights import WeightManifest
from rolledger.workers.engines.protocol import (
    CommitReport,
    EngineError,
    IllegalEngineOrder,
    TensorSpec,
    WeightValidationError,
)
from rolledger.workers.engines.spec_counters import SpecCounters, acceptance, read_spec_counters
from rolledger.workers.engines.vllm_facts import ServerFacts
from rolledger.workers.engines.vllm_http import VllmHttp
from rolledger.workers.engines.vllm_state import VllmRankState


class VllmUpdate:
    """The weights of a vLLM rank (a mixin of VllmEngine, which sets the attributes below)."""

    rank: int
    reset_deadline_s: float
    http: VllmHttp
    _st: VllmRankState
    facts: ServerFacts
    _resumed: threading.Condition
    _tmp_staging: tempfile.TemporaryDirectory[str] | None

    def _spec_counters(self) -> SpecCounters | None:
        """The server's draft counters now (None where it exports none, or /metrics does not answer)."""
        try:
            return read_spec_counters(self.http.request("GET", "/metrics").text)
        except (EngineError, ValueError):
            return None

    def _spec_window_before_commit(self) -> None:
        """Where a draft runs: its acceptance over what the rank served since its previous probe, read before the
        weights change (the probe after the commit compares with it)."""
        if self.facts.speculative:
            now = self._spec_counters()
            self._st.spec_before, self._st.spec_mark = acceptance(self._st.spec_mark, now), now

    def _answers(self, results: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
        bad = [r for r in results if not r.get("ok")]
        if bad:
            r = bad[0]
            tensor = r.get("tensor")
            reason = f"worker {r.get('rank')} {what}: {r.get('error')}"
            if tensor and tensor != "*" and what == "prepare":
                raise WeightValidationError(
                    str(tensor), f"{r.get('reason')} (rank {self.rank}, vLLM worker {r.get('rank')}, prepare)"
                )
            raise EngineError(f"rank {self.rank} {reason}")
        return results

    def _one_digest(self, results: list[dict[str, Any]], key: str) -> str:
        digests = {str(r.get(key, "")) for r in results}
        if len(digests) != 1:
            raise EngineError(f"rank {self.rank}: vLLM workers disagree on {key}: {sorted(digests)}")
        return digests.pop()

    def live_tensor_specs(self) -> Mapping[str, TensorSpec]:
        specs = self._answers(self.http.rpc("rolledger_specs"), "specs")[0]["specs"]
        return {name: TensorSpec(shape=tuple(shape), dtype=str(dtype)) for name, (shape, dtype) in specs.items()}

    def prepare(self, version: int, uri: str, manifest: WeightManifest) -> str:
        """The Engine prepare path: the server's own workers read and verify the staged files (prepare_from_uri)."""
        return self.prepare_from_uri(version, uri, manifest)

    def prepare_from_uri(self, version: int, uri: str, manifest: Any) -> str:
        """Every vLLM worker reads and validates the staged update at `uri`; returns the staged weights digest.

        `manifest`: a schemas.weights.WeightManifest, its JSON string, or a dict. Raises WeightValidationError naming
        the tensor (or EngineError); the live weights keep serving either way.
        """
        self._st.sleep.check_weights_awake(f"prepare v{version}", self.rank)
        if hasattr(manifest, "model_dump_json"):
            manifest_json = manifest.model_dump_json()
        elif isinstance(manifest, str):
            manifest_json = manifest
        else:
            manifest_json = json.dumps(manifest)
        self._st.staged_version = None
        results = self._answers(self.http.rpc("rolledger_prepare", version, uri, manifest_json), "prepare")
        self._st.staged_version = version
        return self._one_digest(results, "staged_digest")

    def stage_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> str:
        """Write `tensors` to a private temporary staging directory, then prepare_from_uri (local servers only)."""
        from rolledger.workers.weights.staging_store import DirectoryStagingStore

        self._st.sleep.check_weights_awake(f"stage v{version}", self.rank)
        if self._tmp_staging is None:
            self._tmp_staging = tempfile.TemporaryDirectory(prefix=f"rolledger-vllm-rank{self.rank}-")
        store = DirectoryStagingStore(self._tmp_staging.name)
        if version in store.versions():
            import shutil

            shutil.rmtree(store.version_dir(version))
        staged = store.stage(version, self._st.policy_version, tensors)
        return self.prepare_from_uri(version, staged.uri, staged.manifest)

    def commit_weights(self, version: int) -> CommitReport:
        self._st.sleep.check_weights_awake(f"commit v{version}", self.rank)
        if self._st.staged_version != version:
            raise IllegalEngineOrder(
                f"rank {self.rank}: commit of version {version} but staged is {self._st.staged_version}"
            )
        self._st.staged_version = None
        self._spec_window_before_commit()
        results = self._answers(self.http.rpc("rolledger_commit", version), "commit")
        digest = self._one_digest(results, "digest")
        self._publish(version, digest)
        return CommitReport(
            policy_version=version,
            weights_digest=digest,
            cache_generation=self._st.cache_generation,
            graph_generation=self._st.graph_generation,
            graphs_invalidated=False,  # same shapes, reloaded in place: vLLM keeps its graphs
        )

    def rollback_weights(self) -> CommitReport:
        """Back to the version before the last commit, on every worker; version label and prefix cache follow."""
        self._st.sleep.check_weights_awake("rollback", self.rank)
        results = self._answers(self.http.rpc("rolledger_rollback"), "rollback")
        digest = self._one_digest(results, "digest")
        version = int(results[0]["version"])
        self._publish(version, digest)
        return CommitReport(version, digest, self._st.cache_generation, self._st.graph_generation, False)

    def _publish(self, version: int, digest: str) -> None:
        """After the weights changed: version label (checked), prefix cache reset, local state."""
        with self._resumed:
            self._st.sleep = self._st.sleep.committed()
        self._st.weights_digest = digest
        self._st.policy_version = version
        self.http.post("/update_weight_version", json={"new_version": str(version)})
        got = self.http.get("/weight_info").get("weight_version")
        if got != str(version):
            raise EngineError(f"rank {self.rank}: /weight_info says {got!r} after setting version {version}")
        self.reset_prefix_cache()

    def discard_weights(self) -> None:
        self._answers(self.http.rpc("rolledger_discard"), "discard")
        self._st.staged_version = None

    def inject(self, spec: str) -> None:
        """Arm a one-shot fault in every worker (tests/demos): see workers.weights.vllm_extension.FAULTS."""
        self._answers(self.http.rpc("rolledger_inject", spec), "inject")

    def reset_prefix_cache(self) -> int:
        """POST /reset_prefix_cache until it says success (it answers 200 success:false while blocks are held)."""
        deadline = time.monotonic() + self.reset_deadline_s
        delay = 0.01
        while True:
            body = self.http.post("/reset_prefix_cache")
            if body.get("success") is True:
                break
            if time.monotonic() + delay > deadline:
                raise EngineError(
                    f"rank {self.rank}: /reset_prefix_cache still answers success:false after "
                    f"{self.reset_deadline_s}s (requests still hold cache blocks; pause first)"
                )
            time.sleep(delay)  # retry backoff, bounded by the deadline above
            delay = min(delay * 2, 0.5)
        self._st.cache_generation += 1
        return self._st.cache_generation

    def weights_digest(self) -> str:
        return self._one_digest(self._answers(self.http.rpc("rolledger_digest"), "digest"), "digest")

    def live_digest(self) -> str:
        """Digest of what actually serves (live parameters and repacked kernels); comparable within one server."""
        return self._one_digest(self._answers(self.http.rpc("rolledger_live_digest"), "live digest"), "live_digest")
