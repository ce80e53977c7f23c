"""A FAKE vLLM server for the sleep routes, which a real vLLM cannot serve here: vLLM refuses --enable-sleep-mode on
CPU, so the colocated order (sleep -> wake weights -> update -> wake kv_cache) cannot be driven against a real server
on this machine. `FakeVllmSleepServer` answers the HTTP routes the real `VllmEngine` client sends, over loopback, so
that client is driven unchanged:

- the sleep routes follow the rules vLLM 0.33 states (../shared/reference/vllm-sglang-rl-api.md, 1.2 and 1.6):
  `/sleep?level=` pauses the scheduler and puts both tags to sleep (a second sleep while the weights sleep does
  nothing); `/wake_up?tags=` wakes the named tags, but asked for a tag that does not sleep it wakes nothing and
  answers `status: sleeping`; the scheduler resumes only once every tag is awake; `/is_sleeping` is true while
  paused too. Level 2 discards the weights: a weights wake leaves them zero until new weights are loaded.
- what vLLM would crash or hang on is recorded in `violations` and refused with a 500: a weight RPC while the
  weights sleep (vLLM #57853 segfaults EngineCore), a completion while a tag sleeps (#44395), `/resume` while a tag
  sleeps. A test asserts `violations == []`.
- `FakeSglangSleepServer` does the same for `SglangEngine` and SGLang 0.5.23's routes (reference 6):
  `/release_memory_occupation` and `/resume_memory_occupation` with tags (null: all); releasing a tag already
  released, resuming one that is not, `/update_weights_from_disk` while the weights are released and `/generate`
  while any tag is released are violations; `/weights_checker` reports SGLang's per-parameter checksums of the live
  model (workers.engines.sglang_weights.expected_checksums: qkv/gate_up stacked, the vocabulary padded).
- the vLLM weight RPCs are the real rolledger worker extension (workers.weights.vllm_extension.RolledgerWorkerExtension) mixed
  into a fake worker whose model runner is a real torch model; completions are that model's, run by a real
  TorchEngine over it (raw logprobs), so what the contract checks against torch holds.
- configured with a speculative draft (`server_config={"speculative_config": {...}}`), `/metrics` exports vLLM's
  draft counters (`vllm:spec_decode_num_draft_tokens_total`, `..._accepted_tokens_total`): every generated token
  counts `SPEC_TOKENS` drafted and `acceptance` of them accepted, so a test sets `acceptance` to what the draft
  would achieve against the weights being served (the fake runs no draft model).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, urlsplit

import torch
from safetensors.torch import load_file

from rolledger.schemas.config import SamplingParams
from rolledger.workers.engines.protocol import EngineError, GroupOutput
from rolledger.workers.engines.sglang_weights import expected_checksums
from rolledger.workers.engines.torch_engine import TorchEngine

SPEC_TOKENS = 3  # draft tokens proposed per generated token, with a speculative draft configured
from rolledger.workers.weights.vllm_extension import RolledgerWorkerExtension

TAGS = ("weights", "kv_cache")
# the worker RPCs that read or write the model's weights (vLLM: memory that is unmapped while the weights sleep)
WEIGHT_RPCS = {"rolledger_prepare", "rolledger_commit", "rolledger_rollback", "rolledger_live_digest"}


class _FakeRunner:
    """The model runner the extension reloads weights through: a real torch model."""

    def __init__(self, model: torch.nn.Module, on_reload: Any) -> None:
        self.model = model
        self._on_reload = on_reload

    def reload_weights(self, weights_iterator: Any) -> None:
        self._on_reload(dict(weights_iterator))


class FakeWorker(RolledgerWorkerExtension):
    """One vLLM worker with the real rolledger extension, over a real torch model."""

    def __init__(self, model: torch.nn.Module, model_dir: Path, on_reload: Any) -> None:
        self.model_runner = _FakeRunner(model, on_reload)
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=str(model_dir), hf_config=model.config))
        self.rank = 0


class _FakeServer:
    """A fake server on a free loopback port, in a thread of its own, generating with a real TorchEngine over the
    model; `url` to connect, `close()` to stop. Subclasses answer `route`."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.engine = TorchEngine(model, tokenizer, rank=0)
        self.lock = threading.Lock()
        self.asleep: set[str] = set()
        self.violations: list[str] = []  # what the real server would crash or hang on
        self.calls: list[str] = []  # the sleep routes called, with their tags, in order
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self.engine.close()

    def route(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        raise NotImplementedError

    def _refuse(self, what: str) -> tuple[int, Any]:
        self.violations.append(what)
        return 500, {"error": {"message": f"fake server: {what}", "type": "InternalServerError", "code": 500}}

    def _generate(self, prompt: list[int], n: int, sampling: SamplingParams) -> GroupOutput:
        return self.engine.generate(prompt, n, sampling)

    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        """New weights into the live model, in place (what serves changes); the prefix cache goes."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, t in tensors.items():
                params[name].copy_(t)
        self.engine.reset_prefix_cache()

    def _discard_weights(self) -> None:
        """A level-2 sleep's weights: uninitialised after the wake until new ones load (zero here)."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()
        self.engine.reset_prefix_cache()


class FakeVllmSleepServer(_FakeServer):
    """The fake vLLM server (see the module docstring)."""

    def __init__(
        self, model: Any, tokenizer: Any, model_dir: Path, *, server_config: dict[str, dict[str, Any]] | None = None
    ) -> None:
        super().__init__(model, tokenizer)
        self.server_config = server_config or {}  # merged into /server_info's vllm_config, section by section
        self.worker = FakeWorker(model, model_dir, self._load)
        self.level = 0
        self.paused = False
        self.version = "default"
        self.acceptance = 0.8  # with a speculative draft configured: the share of drafted tokens accepted,
        self.acceptance_by_version: dict[str, float] = {}  # or this, while the version label is a key here
        self.drafted = 0
        self.accepted = 0.0

    # -- routes -------------------------------------------------------------------------------------------------

    def route(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        with self.lock:
            if path in ("/sleep", "/wake_up"):
                self.calls.append(f"{path}?{'&'.join(f'{k}={v}' for k, vs in sorted(query.items()) for v in vs)}")
            match path:
                case "/version":
                    return 200, {"version": "0.33.0+fake"}
                case "/server_info":
                    dtype = f"torch.{next(self.model.parameters()).dtype}".replace("torch.torch.", "torch.")
                    cfg: dict[str, Any] = {
                        "model_config": {"logprobs_mode": "raw_logprobs", "enable_sleep_mode": True, "dtype": dtype},
                        "cache_config": {"enable_prefix_caching": True, "cache_dtype": "auto"},
                        "speculative_config": None,
                    }
                    for section, values in self.server_config.items():
                        cfg[section] = {**(cfg.get(section) or {}), **values}
                    return 200, {"vllm_config": cfg, "vllm_env": {}, "system_env": {}}
                case "/weight_info":
                    return 200, {"weight_version": self.version}
                case "/v1/models":
                    return 200, {"object": "list", "data": [{"id": "fake", "object": "model"}]}
                case "/update_weight_version":
                    self.version = str(body["new_version"])
                    return 200, {"success": True, "new_version": self.version}
                case "/health":
                    return 200, None
                case "/metrics":
                    return 200, self._metrics()
                case "/pause":
                    self.paused = True
                    return 200, {"status": "paused"}
                case "/resume":
                    if self.asleep:
                        return self._refuse(f"/resume while {sorted(self.asleep)} sleep")
                    self.paused = False
                    return 200, {"status": "resumed"}
                case "/is_paused":
                    return 200, {"is_paused": self.paused}
                case "/is_sleeping":
                    return 200, {"is_sleeping": bool(self.asleep) or self.paused}
                case "/sleep":
                    return self._sleep(int(query.get("level", ["1"])[0]))
                case "/wake_up":
                    return self._wake(query.get("tags") or list(TAGS))
                case "/reset_prefix_cache":
                    self.engine.reset_prefix_cache()
                    return 200, {"success": True}
                case "/collective_rpc":
                    name = str(body.get("method"))
                    if name in WEIGHT_RPCS and "weights" in self.asleep:
                        return self._refuse(f"{name} while the weights sleep (vLLM #57853: EngineCore segfaults)")
                    result = getattr(self.worker, name)(*(body.get("args") or []))
                    return 200, {"results": [result]}
        if path == "/v1/completions":  # outside the lock: the model runs, sleep routes stay answerable
            return self._complete(body)
        return 404, {"error": {"message": f"fake vLLM: no route {method} {path}", "code": 404}}

    def _metrics(self) -> str:
        """The Prometheus page: vLLM's draft counters where a speculative draft is configured, else empty."""
        if not (self.server_config.get("speculative_config") or {}):
            return ""
        return "".join(
            f"# HELP vllm:{name}_total {name}.\n# TYPE vllm:{name}_total counter\n"
            f'vllm:{name}_total{{engine="0",model_name="fake"}} {value:.1f}\n'
            for name, value in (
                ("spec_decode_num_draft_tokens", self.drafted),
                ("spec_decode_num_accepted_tokens", self.accepted),
            )
        )

    def _count_drafts(self, tokens: int) -> None:
        if self.server_config.get("speculative_config"):
            with self.lock:
                self.drafted += SPEC_TOKENS * tokens
                rate = self.acceptance_by_version.get(self.version, self.acceptance)
                self.accepted += rate * SPEC_TOKENS * tokens

    def _sleep(self, level: int) -> tuple[int, Any]:
        if "weights" not in self.asleep:  # vLLM: "Executor is already sleeping." -> nothing
            self.asleep, self.level = set(TAGS), level
        self.paused = True  # sleep is a pause plus a memory action
        return 200, {"status": "sleeping", "level": level}

    def _wake(self, tags: list[str]) -> tuple[int, Any]:
        if not self.asleep:  # "Executor is not sleeping.": fully awake, the scheduler resumes (undoes a /pause)
            self.paused = False
            return 200, {"status": "awake", "tags": tags}
        if any(t not in self.asleep for t in tags):  # "Tag %s is not in sleeping tags": wakes nothing
            return 200, {"status": "sleeping", "tags": tags}
        if "weights" in tags and self.level == 2:  # level 2 discarded them: uninitialised until new ones load
            self._discard_weights()
        self.asleep -= set(tags)
        if not self.asleep:
            self.level, self.paused = 0, False  # fully awake: the scheduler resumes
        return 200, {"status": "sleeping" if self.asleep else "awake", "tags": tags}

    def _complete(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.lock:
            if self.asleep:
                return self._refuse(f"/v1/completions while {sorted(self.asleep)} sleep (vLLM #44395)")
            if self.paused:
                return 503, {"error": {"message": "Generation is paused. Please retry after it resumes.", "code": 503}}
        prompts = body["prompt"]
        prompts = prompts if prompts and isinstance(prompts[0], list) else [prompts]
        top_k = int(body.get("top_k", -1))
        sampling = SamplingParams(
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)),
            top_k=max(top_k, 0),
            max_tokens=int(body.get("max_tokens", 16)),
            seed=body.get("seed"),
            logprob_mode="raw",
        )
        choices: list[dict[str, Any]] = []
        prompt_tokens = 0
        try:
            for prompt in prompts:
                out = self._generate(prompt, int(body.get("n", 1)), sampling)
                self._count_drafts(sum(len(s.token_ids) for s in out.samples))
                prompt_tokens += len(prompt)
                for s in out.samples:
                    choices.append(
                        {
                            "index": len(choices),
                            "token_ids": s.token_ids,
                            "logprobs": {"token_logprobs": s.logprobs},
                            "finish_reason": s.finish_reason,
                        }
                    )
        except EngineError as e:
            return 500, {"error": {"message": f"fake vLLM: {e}", "code": 500}}
        usage = {"prompt_tokens": prompt_tokens, "prompt_tokens_details": {"cached_tokens": 0}}
        return 200, {"choices": choices, "usage": usage, "stream": bool(body.get("stream"))}


SGLANG_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang.srt.constants.GPU_MEMORY_ALL_TYPES


class FakeSglangSleepServer(_FakeServer):
    """The fake SGLang server (see the module docstring); `model_dir` is its start-up checkpoint (`model_path`)."""

    def __init__(
        self, model: Any, tokenizer: Any, model_dir: Path, *, server_info: dict[str, Any] | None = None
    ) -> None:
        super().__init__(model, tokenizer)
        self.server_info = server_info or {}  # merged into /server_info (server args)
        self.model_dir = model_dir
        self.paused = False
        self.version = "default"

    def route(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        with self.lock:
            if path in ("/release_memory_occupation", "/resume_memory_occupation"):
                self.calls.append(f"{path}?tags={body.get('tags')}")
            match path:
                case "/server_info":
                    return 200, {
                        "version": "0.5.23+fake",
                        "device": "cuda",
                        "enable_memory_saver": True,
                        "disable_radix_cache": False,
                        "model_path": str(self.model_dir),
                        "speculative_algorithm": None,
                        "kv_cache_dtype": "auto",
                        **self.server_info,
                    }
                case "/model_info":
                    return 200, {"weight_version": self.version}
                case "/update_weight_version":
                    self.version = str(body["new_version"])
                    return 200, {"success": True, "message": "ok", "new_version": self.version}
                case "/pause_generation":
                    self.paused = True
                    return 200, {"message": "Generation paused successfully.", "status": "ok"}
                case "/continue_generation":
                    if self.asleep:
                        return self._refuse(f"/continue_generation while {sorted(self.asleep)} are released")
                    self.paused = False
                    return 200, {"message": "Generation continued successfully.", "status": "ok"}
                case "/flush_cache":
                    self.engine.reset_prefix_cache()
                    return 200, "Cache flushed."
                case "/weights_checker":
                    if "weights" in self.asleep:
                        return self._refuse("/weights_checker while the weights are released")
                    live = {n: p.data for n, p in self.model.named_parameters()}
                    checksums = {param: c for param, (c, _) in expected_checksums(live).items()}
                    return 200, {"success": True, "ranks": [{"checksums": checksums}]}
                case "/update_weights_from_disk":
                    if "weights" in self.asleep:
                        return self._refuse("/update_weights_from_disk while the weights are released")
                    tensors: dict[str, torch.Tensor] = {}
                    for f in sorted(Path(body["model_path"]).glob("*.safetensors")):
                        tensors.update(load_file(str(f)))
                    self._load(tensors)
                    if body.get("weight_version") is not None:
                        self.version = str(body["weight_version"])
                    return 200, {
                        "success": True,
                        "message": "Succeeded to update model weights.",
                        "num_paused_requests": 0,
                    }
                case "/release_memory_occupation":
                    tags = body.get("tags") or list(SGLANG_TAGS)
                    if again := sorted(set(tags) & self.asleep):
                        return self._refuse(f"release of {again}, already released")
                    self.asleep |= set(tags)
                    return 200, None
                case "/resume_memory_occupation":
                    tags = body.get("tags") or list(SGLANG_TAGS)
                    if awake := sorted(set(tags) - self.asleep):
                        return self._refuse(f"resume of {awake}, not released")
                    self.asleep -= set(tags)
                    return 200, None
        if path == "/generate":
            return self._sglang_generate(body)
        return 404, {"error": {"message": f"fake SGLang: no route {method} {path}", "code": 404}}

    def _sglang_generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.lock:
            if self.asleep:
                return self._refuse(f"/generate while {sorted(self.asleep)} are released")
            if self.paused:
                return self._refuse("/generate while paused (SGLang holds it at its door until continued)")
            version = self.version
        params = body.get("sampling_params") or {}
        top_k = int(params.get("top_k", -1))
        sampling = SamplingParams(
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=max(top_k, 0),
            max_tokens=int(params.get("max_new_tokens", 16)),
            seed=params.get("sampling_seed"),
            logprob_mode="raw",
        )
        n = int(params.get("n", 1))
        try:
            out = self._generate(list(body["input_ids"]), n, sampling)
        except EngineError as e:
            return 500, {"error": {"message": f"fake SGLang: {e}", "code": 500}}
        items = [
            {
                "output_ids": s.token_ids,
                "meta_info": {
                    "output_token_logprobs": [[lp, t, None] for lp, t in zip(s.logprobs, s.token_ids, strict=True)],
                    "weight_version": version,
                    "finish_reason": {"type": s.finish_reason},
                    "cached_tokens": 0,
                },
            }
            for s in out.samples
        ]
        return 200, items if n > 1 else items[0]


def _handler(server: _FakeServer) -> type[BaseHTTPRequestHandler]:
    """The request handler: JSON in, JSON (or text, or server-sent events) out, through `route`."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _serve(self, method: str) -> None:
            split = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else {}
            status, answer = server.route(method, split.path, parse_qs(split.query), body)
            if isinstance(answer, dict) and answer.pop("stream", False) and status == 200:
                self._stream(answer)
                return
            data = b"" if answer is None else (answer if isinstance(answer, str) else json.dumps(answer)).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(answer, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, answer: dict[str, Any]) -> None:
            """Server-sent events: one per choice (all its tokens and its finish reason), the usage, [DONE]."""
            events = [{"choices": [c]} for c in answer["choices"]] + [{"choices": [], "usage": answer["usage"]}]
            data = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

    return Handler
