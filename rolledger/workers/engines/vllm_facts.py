"""What a vLLM rank learns from its server when it connects: its version and config (ServerFacts) and the meaning
of its weight version label.
"""

from __future__ import annotations

from dataclasses import dataclass

from rolledger.workers.engines.protocol import EngineError
from rolledger.workers.engines.vllm_http import VllmHttp


@dataclass(frozen=True)
class ServerFacts:
    """What the engine learned about the server when it connected."""

    version: str
    logprob_mode: str  # "raw" | "processed"
    logprobs_mode_raw: str  # vLLM's own name, e.g. "raw_logprobs"
    sleep_mode: bool
    prefix_caching: bool
    workers: int
    speculative: str = ""  # the speculative method/draft model configured ('' when none)
    kv_cache_dtype: str = "auto"  # cache_config.cache_dtype ("auto", "fp8", "fp8_e4m3", ...)


def server_facts(http: VllmHttp) -> ServerFacts:
    """Ask the server for its version and config; EngineError when it cannot serve rolledger (dev mode off, logits)."""
    version = str(http.get("/version").get("version", "unknown"))
    info = http.get("/server_info", params={"config_format": "json"})
    cfg = info.get("vllm_config")
    if not isinstance(cfg, dict):
        raise EngineError(
            f"vLLM /server_info at {http.base_url} returned no JSON config; is VLLM_SERVER_DEV_MODE=1 set?"
        )
    model_cfg = cfg.get("model_config") or {}
    cache_cfg = cfg.get("cache_config") or {}
    mode = str(model_cfg.get("logprobs_mode", "raw_logprobs"))
    if mode not in ("raw_logprobs", "processed_logprobs"):
        raise EngineError(
            f"vLLM at {http.base_url} runs --logprobs-mode {mode}: rolledger needs logprobs "
            "(raw_logprobs or processed_logprobs), not logits"
        )
    workers = len(http.rpc("rolledger_digest"))
    return ServerFacts(
        version=version,
        logprob_mode="processed" if mode.startswith("processed") else "raw",
        logprobs_mode_raw=mode,
        sleep_mode=bool(model_cfg.get("enable_sleep_mode", False)),
        prefix_caching=bool(cache_cfg.get("enable_prefix_caching", False)),
        workers=workers,
        speculative=_speculative(cfg.get("speculative_config")),
        kv_cache_dtype=str(cache_cfg.get("cache_dtype") or "auto"),
    )


def _speculative(spec: object) -> str:
    """A short name for vllm_config.speculative_config: '' when none, else its method and draft model."""
    if not spec:
        return ""
    if isinstance(spec, dict):
        named = [str(spec[k]) for k in ("method", "model") if spec.get(k)]
        return " ".join(named) or "speculative_config"
    return str(spec)[:80]


def parse_version(label: str) -> int:
    """vLLM's weight version label as a policy version: 'default' (never set) is version 0."""
    if label == "default":
        return 0
    try:
        return int(label)
    except ValueError as e:
        raise EngineError(f"vLLM weight_version {label!r} is not a rolledger policy version") from e
