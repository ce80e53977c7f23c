"""Build the engines of a run, one per rank, from the run config and the saved policy directory.

- `engine = "torch"`: one TorchEngine per rank, each loading the saved policy (`torch_engine`): in-process, or with
  `torch_engine.process` in a process of its own (workers/engines/engine_process).
- `engine = "vllm"`: one `VllmEngine` (HTTP) per rank. With `cfg.vllm_urls` the servers already run (one URL per
  rank; netguard refuses non-private addresses unless `cfg.allow_remote_engines`); otherwise `cfg.ranks` servers are
  started here from the run's saved policy (`model_dir`) on free loopback ports, logging to
  `run_dir/vllm-rank{r}.log`, and the returned close function stops them.
- `engine = "simulated"`: one in-process SimulatedEngine per rank (benchmarks of the control plane: tokens cost the
  declared time of config section `simulated`; weights, probe and sleep are a real TorchEngine's over the policy).
- `engine = "sglang"`: one `SglangEngine` per rank, the same way (`cfg.sglang_urls`, or servers started here by
  workers.engines.sglang_server with this interpreter, logging to `run_dir/sglang-rank{r}.log`).

A vLLM rank must serve exactly the run's initial policy, in the policy's own dtype: the trainer checks the
engine's logprobs against its own weights (median gap <= trainer.max_logprob_gap) and the audit checks that
version-0 samples carry RunStarted's initial weights digest. So servers are started with `--dtype` equal to the
checkpoint's dtype (vLLM's `auto` would downcast a float32 checkpoint to bfloat16), and already-running servers are
checked before the run starts: policy version 0, the initial weights digest, the run's logprob mode, the dtype.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rolledger.schemas.config import RunConfig
from rolledger.workers.engines.protocol import Engine, EngineError


def build_engines(
    cfg: RunConfig, model_dir: Path, tokenizer: Any, run_dir: Path
) -> tuple[list[Engine], Callable[[], None]]:
    """The engines for `cfg.ranks` ranks and a function that releases them (servers started here are stopped)."""
    if cfg.engine == "torch":
        from rolledger.workers.policy.policy_model import load_policy

        engines: list[Engine] = []
        for r in range(cfg.ranks):
            model, _ = load_policy(model_dir)
            engines.append(torch_engine(cfg, model, tokenizer, rank=r))

        def close() -> None:
            for e in engines:
                e.close()

        return engines, close
    if cfg.engine == "simulated":
        from rolledger.workers.policy.policy_model import load_policy

        engines = [simulated_engine(cfg, *load_policy(model_dir), rank=r) for r in range(cfg.ranks)]

        def close_simulated() -> None:
            for e in engines:
                e.close()

        return engines, close_simulated
    if cfg.engine == "vllm":
        vllm_engines, close_vllm = build_vllm_engines(cfg, model_dir, run_dir)
        return list(vllm_engines), close_vllm
    if cfg.engine == "sglang":
        return build_sglang_engines(cfg, model_dir, run_dir)
    raise NotImplementedError(f"engine {cfg.engine!r} is not wired into `rolledger run` yet")


def torch_engine(cfg: RunConfig, model: Any, tokenizer: Any, *, rank: int) -> Engine:
    """The torch engine of one rank as the run config says (`rolledger run` and `rolledger worker rank` alike): its
    groups batched when the rank has several slots, at most `torch_engine.max_batch_groups` of them a step, and, with
    `torch_engine.process`, in a process of its own (its model sent there by value)."""
    from functools import partial

    from rolledger.workers.engines.torch_engine import TorchEngine

    build = partial(
        TorchEngine,
        model,
        tokenizer,
        rank=rank,
        interruptible=cfg.interruptible,
        batch_groups=cfg.rank_slots > 1,
        max_batch_groups=cfg.torch_engine.max_batch_groups or None,
    )
    if not cfg.torch_engine.process:
        return build()
    from rolledger.workers.engines.engine_process import EngineProcess

    return EngineProcess(build, name=f"torch-rank{rank}")


def simulated_engine(cfg: RunConfig, model: Any, tokenizer: Any, *, rank: int) -> Engine:
    """A SimulatedEngine (benchmarks: declared token times, cfg.simulated) for one rank, over the run's policy."""
    from rolledger.workers.engines.simulated_engine import SimulatedEngine

    return SimulatedEngine(model, tokenizer, cfg.simulated, rank=rank, interruptible=cfg.interruptible)


# ------------------------------------------------------------------------------------------------------- vLLM


def checkpoint_dtype(model_dir: Path) -> str:
    """The dtype the saved policy was written in (config.json `dtype`, or `torch_dtype` from older transformers)."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EngineError(f"cannot read the policy's config {path}: {e}") from e
    dtype = config.get("dtype") or config.get("torch_dtype")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise EngineError(f"{path}: field 'dtype' is {dtype!r}; expected float32, bfloat16 or float16")
    return str(dtype)


def initial_digest(model_dir: Path) -> str:
    """state_digest of the saved policy, computed exactly as RunStarted's initial_weights_digest is."""
    from rolledger.workers.policy.policy_model import load_policy, policy_state
    from rolledger.workers.weights.tensors import state_digest

    model, _ = load_policy(model_dir)
    return state_digest(policy_state(model))


def served_model_name(base_url: str, timeout_s: float = 30.0) -> str:
    """The model name an already-running server serves (GET /v1/models, the first entry)."""
    import httpx

    try:
        resp = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=timeout_s)
        resp.raise_for_status()
        data = resp.json().get("data") or []
        return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise EngineError(f"vLLM at {base_url}: cannot read its model name from /v1/models: {e}") from e


def server_dtype(engine: Any) -> str:
    """The dtype the server computes in (its vllm_config.model_config.dtype, e.g. 'torch.float32' -> 'float32')."""
    cfg = engine.http.get("/server_info", params={"config_format": "json"}).get("vllm_config") or {}
    return str((cfg.get("model_config") or {}).get("dtype", "unknown")).removeprefix("torch.")


def check_level_2(engine: Any, where: str, cfg: RunConfig) -> None:
    """Seed 004's level-2 rules: a colocated run at sleep_level 2 on a server with a speculative draft or an FP8 KV
    cache is refused, one line saying why (workers.engines.sleep_state.level_2_refusal)."""
    reason = getattr(engine, "level_2_refused", "")
    if cfg.mode == "colocated" and cfg.sleep_level == 2 and reason:
        raise EngineError(f"{where}: mode 'colocated' at sleep_level 2 is refused: {reason}; use sleep_level 1")


def check_rank_engine(engine: Any, url: str, cfg: RunConfig, want_digest: str, want_dtype: str) -> None:
    """Refuse a server that cannot be rank `engine.rank` of a fresh run (clear errors naming the field)."""
    where = f"vLLM rank {engine.rank} at {url}"
    logprob_mode = cfg.sampling.logprob_mode
    check_level_2(engine, where, cfg)
    if cfg.mode == "colocated" and cfg.sleep_level not in engine.capabilities.sleep_levels:
        raise EngineError(
            f"{where}: mode 'colocated' sleeps the rank at sleep_level {cfg.sleep_level}, but the server runs "
            "without sleep mode (vLLM refuses --enable-sleep-mode on CPU); use mode 'disaggregated'"
        )
    if engine.policy_version != 0:
        raise EngineError(
            f"{where} serves policy version {engine.policy_version} (/weight_info); a run starts its ranks on "
            "version 0: restart the server from the run's model directory"
        )
    if engine.capabilities.logprob_mode != logprob_mode:
        raise EngineError(
            f"{where} computes {engine.facts.logprobs_mode_raw} but sampling.logprob_mode is {logprob_mode!r} "
            f"(start it with --logprobs-mode {logprob_mode}_logprobs)"
        )
    dtype = server_dtype(engine)
    if dtype != want_dtype:
        raise EngineError(
            f"{where} computes in {dtype} but the policy is {want_dtype}: the trainer's logprob-agreement check "
            f"would halt the run (start it with --dtype {want_dtype})"
        )
    digest = engine.weights_digest()
    if digest != want_digest:
        raise EngineError(
            f"{where} serves weights {digest}, not the run's initial policy {want_digest}: start it from the run's "
            "model directory (runs/<run-id>/model)"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_in_parallel(what: str, n: int, launch: Callable[[int], Any]) -> list[Any]:
    """`launch(rank)` for ranks 0..n-1 on their own threads (each with its own start-up deadline); on any failure
    stop the servers that started and raise the first error."""
    servers: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            servers[rank] = launch(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised below on the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,), name=f"{what}-start-{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # each launch has its own start-up deadline
    started = [s for s in servers if s is not None]
    if errors:
        for s in started:
            s.close()
        raise errors[0]
    return started


def start_rank_servers(cfg: RunConfig, model_dir: Path, run_dir: Path) -> list[Any]:
    """Start `cfg.ranks` vLLM servers from `model_dir` in parallel; on any failure stop the others and raise."""
    from rolledger.workers.engines.vllm_server import start_vllm_server

    dtype = checkpoint_dtype(model_dir)
    extra = ["--logprobs-mode", f"{cfg.sampling.logprob_mode}_logprobs"]
    return start_in_parallel(
        "vllm",
        cfg.ranks,
        lambda rank: start_vllm_server(
            model_dir, _free_port(), log_path=run_dir / f"vllm-rank{rank}.log", dtype=dtype, extra_args=extra
        ),
    )


def connect_vllm_rank(cfg: RunConfig, rank: int, model_dir: Path) -> Any:
    """The VllmEngine of one rank of a distributed run (`rolledger worker rank --rank R`): the server at
    cfg.vllm_urls[R], address-checked, and checked against the run's initial policy like build_vllm_engines does."""
    from rolledger.workers.engines.vllm_engine import VllmEngine
    from rolledger.workers.runtime.netguard import check_engine_address

    if rank >= len(cfg.vllm_urls):
        raise ValueError(f"vllm_urls has {len(cfg.vllm_urls)} URL(s); rank {rank} has none (one vLLM server per rank)")
    url = cfg.vllm_urls[rank]
    check_engine_address(url, cfg.allow_remote_engines)
    model_dir = Path(model_dir).absolute()
    engine = VllmEngine(url, rank=rank, model_name=served_model_name(url), allow_remote=cfg.allow_remote_engines)
    try:
        check_rank_engine(engine, url, cfg, initial_digest(model_dir), checkpoint_dtype(model_dir))
    except BaseException:
        engine.close()
        raise
    return engine


def build_vllm_engines(cfg: RunConfig, model_dir: Path, run_dir: Path) -> tuple[list[Any], Callable[[], None]]:
    """One VllmEngine per rank, checked against the run's initial policy, and the close function."""
    from rolledger.workers.runtime.netguard import check_engine_address

    model_dir = Path(model_dir).absolute()
    from rolledger.workers.engines.vllm_engine import VllmEngine

    want_dtype = checkpoint_dtype(model_dir)
    want_digest = initial_digest(model_dir)
    servers: list[Any] = []
    if cfg.vllm_urls:
        if len(cfg.vllm_urls) != cfg.ranks:
            raise ValueError(
                f"vllm_urls has {len(cfg.vllm_urls)} URL(s) but ranks is {cfg.ranks}: give one vLLM server per rank"
            )
        urls = list(cfg.vllm_urls)
        for url in urls:  # before any request goes out
            check_engine_address(url, cfg.allow_remote_engines)
        names = [served_model_name(u) for u in urls]
    else:
        servers = start_rank_servers(cfg, model_dir, run_dir)
        urls = [s.url for s in servers]
        names = [str(model_dir)] * len(urls)
    engines: list[Any] = []

    def close() -> None:
        for e in engines:
            e.close()
        for s in servers:
            s.close()

    try:
        for r, (url, name) in enumerate(zip(urls, names, strict=True)):
            engine = VllmEngine(url, rank=r, model_name=name, allow_remote=cfg.allow_remote_engines)
            engines.append(engine)
            check_rank_engine(engine, url, cfg, want_digest, want_dtype)
    except BaseException:
        close()
        raise
    return engines, close


# ----------------------------------------------------------------------------------------------------- SGLang


def check_sglang_rank(engine: Any, url: str, cfg: RunConfig, want_digest: str) -> None:
    """Refuse an SGLang server that cannot be rank `engine.rank` of a fresh run (clear errors naming the field)."""
    where = f"SGLang rank {engine.rank} at {url}"
    check_level_2(engine, where, cfg)
    if cfg.mode == "colocated" and cfg.sleep_level not in engine.capabilities.sleep_levels:
        raise EngineError(
            f"{where}: mode 'colocated' sleeps the rank at sleep_level {cfg.sleep_level}, but the server cannot "
            f"release memory (device {engine.device}; SGLang sleeps on a GPU with --enable-memory-saver only); use "
            "mode 'disaggregated'"
        )
    if cfg.sampling.logprob_mode != "raw":
        raise EngineError(
            f"{where}: sampling.logprob_mode must be 'raw' with SGLang (SGLANG_RETURN_ORIGINAL_LOGPROB=1)"
        )
    if engine.policy_version != 0:
        raise EngineError(
            f"{where} serves policy version {engine.policy_version} (/model_info weight_version); a run starts its "
            "ranks on version 0: restart the server from the run's model directory"
        )
    digest = engine.weights_digest()
    if digest != want_digest:
        raise EngineError(
            f"{where} serves weights {digest}, not the run's initial policy {want_digest}: start it from the run's "
            "model directory (runs/<run-id>/model)"
        )


def start_sglang_rank_servers(cfg: RunConfig, model_dir: Path, run_dir: Path) -> list[Any]:
    """Start `cfg.ranks` SGLang servers from `model_dir` in parallel; on any failure stop the others and raise."""
    import importlib.util
    import sys

    from rolledger.workers.engines.sglang_server import start_sglang_server

    if importlib.util.find_spec("sglang") is None:
        raise EngineError(
            f"engine 'sglang' starts its servers with this interpreter ({sys.executable}), which cannot import sglang: "
            "install sglang==0.5.23 into its environment (docs/sglang.md), or give running servers with --sglang-url"
        )
    dtype = checkpoint_dtype(model_dir)
    return start_in_parallel(
        "sglang",
        cfg.ranks,
        lambda rank: start_sglang_server(
            model_dir, _free_port(), log_path=run_dir / f"sglang-rank{rank}.log", dtype=dtype
        ),
    )


def connect_sglang_rank(cfg: RunConfig, rank: int, model_dir: Path) -> Any:
    """The SglangEngine of one rank of a distributed run (`rolledger worker rank --rank R`): the server at
    cfg.sglang_urls[R], address-checked and checked against the run's initial policy."""
    from rolledger.workers.engines.sglang_engine import SglangEngine
    from rolledger.workers.runtime.netguard import check_engine_address

    if rank >= len(cfg.sglang_urls):
        raise ValueError(f"sglang_urls has {len(cfg.sglang_urls)} URL(s); rank {rank} has none (one server per rank)")
    url = cfg.sglang_urls[rank]
    check_engine_address(url, cfg.allow_remote_engines)
    model_dir = Path(model_dir).absolute()
    engine = SglangEngine(url, rank=rank, model_dir=model_dir, allow_remote=cfg.allow_remote_engines)
    try:
        check_sglang_rank(engine, url, cfg, initial_digest(model_dir))
    except BaseException:
        engine.close()
        raise
    return engine


def build_sglang_engines(cfg: RunConfig, model_dir: Path, run_dir: Path) -> tuple[list[Engine], Callable[[], None]]:
    """One SglangEngine per rank (servers at cfg.sglang_urls, or started here), checked against the run's initial
    policy, and the close function."""
    from rolledger.workers.engines.sglang_engine import SglangEngine
    from rolledger.workers.runtime.netguard import check_engine_address

    model_dir = Path(model_dir).absolute()
    want_digest = initial_digest(model_dir)
    servers: list[Any] = []
    if cfg.sglang_urls:
        if len(cfg.sglang_urls) != cfg.ranks:
            raise ValueError(
                f"sglang_urls has {len(cfg.sglang_urls)} URL(s) but ranks is {cfg.ranks}: give one server per rank"
            )
        urls = list(cfg.sglang_urls)
        for url in urls:  # before any request goes out
            check_engine_address(url, cfg.allow_remote_engines)
    else:
        servers = start_sglang_rank_servers(cfg, model_dir, run_dir)
        urls = [s.url for s in servers]
    engines: list[SglangEngine] = []

    def close() -> None:
        for e in engines:
            e.close()
        for s in servers:
            s.close()

    try:
        for r, url in enumerate(urls):
            engine = SglangEngine(url, rank=r, model_dir=model_dir, allow_remote=cfg.allow_remote_engines)
            engines.append(engine)
            check_sglang_rank(engine, url, cfg, want_digest)
    except BaseException:
        close()
        raise
    return list(engines), close
