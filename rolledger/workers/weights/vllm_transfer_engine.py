"""rolledger's weight transport registered as a vLLM weight-transfer engine (`--weight-transfer-config
'{"backend": "rolledger"}'`), so vLLM's own update routes can move a version over it, checked as every rolledger
transport is.

vLLM (0.31+) creates a `WeightTransferEngine` in every worker's `load_model()`, CPU workers included, for the
backend its `--weight-transfer-config` names, and drives it through `/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights` and `/finish_weight_update`. Its own engines need CUDA (NCCL, IPC); this one
is the torch.distributed transport of `workers/weights/transport_dist.py` (gloo on CPU), registered by the
`vllm.general_plugins` entry point `rolledger` (pyproject.toml), which vLLM loads in every process.

The session, per worker, is a prepare-then-commit:
- `/update_weights {"update_info": {"uri": <dist:// or file:// URI of UpdateStaged>, "version": v,
  "manifest_digest": d}}` fetches the manifest (checked against `d`), receives every tensor and verifies it against
  the manifest's checksums into host memory. Nothing is loaded: the live weights keep serving. A tensor that does
  not match is refused naming it (vLLM answers 500 with the message and ends the session).
- `/finish_weight_update` loads the verified version in place (vLLM's `reload_weights`, checkpoint format, as
  `workers/weights/vllm_extension.py` commits, then `reprocess_embeddings`: the reload leaves a tied lm_head's CPU kernel
  packed from the old weights). A session with nothing received loads nothing.
- `{"update_info": {"discard": true}}` drops what was received (the abort of an update another rank failed), so the
  next `/finish_weight_update` loads nothing.

`rolledger run --engine vllm` commits through the worker extension (`workers/weights/vllm_extension.py`), which adds what
vLLM's routes have no place for: rollback to the previous version and the live-digest proof that a commit changed
the weights. A server should take its updates through one of the two routes: the extension does not see a version
loaded through this engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
import torch

log = structlog.get_logger("rolledger.vllm_transfer_engine")

BACKEND = "rolledger"

try:  # vLLM is present only in the vLLM tier's environment (and on inference hosts)
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError:  # pragma: no cover - the module is imported by vLLM only
    WeightTransferEngine = object  # type: ignore[assignment,misc]
    WeightTransferInitInfo = object  # type: ignore[assignment,misc]
    WeightTransferUpdateInfo = object  # type: ignore[assignment,misc]


@dataclass
class RolledgerInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """Nothing to set up once: every version names its own rendezvous in its URI."""


@dataclass
class RolledgerUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """One version to receive (`uri`, `version`, `manifest_digest` as UpdateStaged carries them), or `discard`."""

    uri: str = ""
    version: int = 0
    manifest_digest: str = ""
    timeout_s: float | None = None
    discard: bool = False


class RolledgerTransferEngine(WeightTransferEngine):  # type: ignore[misc]
    """A vLLM weight-transfer engine over rolledger's checked transports (see the module docstring)."""

    init_info_cls = RolledgerInitInfo
    update_info_cls = RolledgerUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._received: dict[str, torch.Tensor] | None = None
        self._received_version = 0

    def init_transfer_engine(self, init_info: RolledgerInitInfo) -> None:
        """Nothing to join: each transfer has its own group, set up by the URI's weight server."""

    def start_weight_update(self) -> None:
        self._received = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which has nothing to wait for here: every byte
        # is in host memory and verified when receive_weights returns
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: RolledgerUpdateInfo) -> None:
        """Receive and verify the version into host memory; StagingError naming the tensor that does not match."""
        from rolledger.workers.weights.staging_format import StagingError
        from rolledger.workers.weights.transport import load_verified, read_manifest
        from rolledger.workers.weights.vllm_extension import TiedHeadDiffers, drop_tied_head

        if update_info.discard:
            self._received = None
            return
        if update_info.version < 1 or not update_info.uri or not update_info.manifest_digest:
            raise ValueError("update_info needs uri, version >= 1 and manifest_digest (or discard: true)")
        manifest = read_manifest(update_info.uri, update_info.version, expected_digest=update_info.manifest_digest)
        got = load_verified(update_info.uri, update_info.version, manifest)
        try:
            tensors = drop_tied_head(dict(got.tensors), self.model_config.hf_config)
        except TiedHeadDiffers as e:
            raise StagingError(e.tensor, e.reason, kind="checksum", version=update_info.version) from e
        self._received, self._received_version = tensors, update_info.version
        log.info("received and verified", version=update_info.version, tensors=len(tensors))

    def finish_weight_update(self) -> None:
        """Load the verified version in place (checkpoint format); nothing when nothing was received."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        received, self._received = self._received, None
        if received is None:
            return
        from rolledger.workers.weights.vllm_extension import reprocess_embeddings

        reload_weights(
            self.vllm_config,
            self.model,
            weights_iterator=iter(received.items()),
            weights_path=None,
            is_checkpoint_format=True,
        )
        reprocess_embeddings(self.model)  # a tied lm_head's CPU kernel is not repacked by the reload
        log.info("loaded", version=self._received_version)

    def shutdown(self) -> None:
        self._received = None


def register() -> None:
    """The `vllm.general_plugins` entry point: make `backend: "rolledger"` known to vLLM's engine factory (once per
    process; vLLM loads general plugins in every process it starts)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # an older vLLM without weight-transfer engines: nothing to register
        return
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, RolledgerTransferEngine.__name__)
    except ValueError:  # already registered in this process
        pass
