"""Benchmark (run by hand): generated tokens/s through VllmEngine.generate vs direct /v1/completions calls.

    .venv-vllm/bin/python bench/bench_vllm.py [--groups 20] [--n 8] [--max-tokens 64] [--repeats 5] [--url URL]

Starts one vLLM CPU server on a free loopback port with the tiny policy (unless --url points at a running one, then
--model-name is needed), warms it up, then runs rounds that alternate the two paths on the same requests (same
prompt, n, sampling and per-group seed, so both generate the same tokens):

- engine: `VllmEngine.generate` (builds the request, posts it, parses choices into SampleOutput, keeps stats);
- direct: `httpx.post("/v1/completions", json=<the same body>)` and a JSON decode, counting `token_ids`.

Prints the median tokens/s of each path over the rounds and the ratio engine/direct (aim >= 0.95).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rolledger.schemas.config import ModelConfig, SamplingParams
from rolledger.workers.engines.vllm_engine import VllmEngine
from rolledger.workers.engines.vllm_server import start_vllm_server

PROMPT = [1, 4, 5, 14, 6, 15]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_engine(engine: VllmEngine, groups: int, n: int, max_tokens: int) -> tuple[int, float]:
    tokens = 0
    t0 = time.perf_counter()
    for g in range(groups):
        out = engine.generate(PROMPT, n, SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=g))
        tokens += sum(len(s.token_ids) for s in out.samples)
    return tokens, time.perf_counter() - t0


def run_direct(engine: VllmEngine, client: httpx.Client, groups: int, n: int, max_tokens: int) -> tuple[int, float]:
    bodies = [
        engine.completion_request(PROMPT, n, SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=g))
        for g in range(groups)
    ]
    tokens = 0
    t0 = time.perf_counter()
    for body in bodies:
        resp = client.post("/v1/completions", json=body)
        resp.raise_for_status()
        tokens += sum(len(c["token_ids"]) for c in resp.json()["choices"])
    return tokens, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=20)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--url", default=None)
    ap.add_argument("--model-name", default=None)
    args = ap.parse_args()

    server = None
    tmp = tempfile.TemporaryDirectory(prefix="rolledger-bench-vllm-")
    try:
        if args.url is None:
            from rolledger.workers.policy.policy_model import build_model, build_tokenizer, save_policy

            tok = build_tokenizer()
            model_dir = save_policy(
                Path(tmp.name) / "model", build_model(ModelConfig(dtype="bfloat16"), len(tok), 0), tok
            )
            server = start_vllm_server(model_dir, _free_port(), log_path=Path(tmp.name) / "vllm.log")
            print(f"server ready in {server.start_s:.1f} s ({server.url})")
            url, name = server.url, str(model_dir)
        else:
            if not args.model_name:
                ap.error("--model-name is required with --url")
            url, name = args.url, args.model_name
        engine = VllmEngine(url, rank=0, model_name=name, timeout_s=120)
        client = httpx.Client(base_url=url, timeout=120)
        run_engine(engine, 3, args.n, args.max_tokens)  # warm-up both paths
        run_direct(engine, client, 3, args.n, args.max_tokens)
        eng_rates, dir_rates = [], []
        for r in range(args.repeats):
            # alternate which path goes first so drift on a shared machine hits both
            order = ("engine", "direct") if r % 2 == 0 else ("direct", "engine")
            for path in order:
                if path == "engine":
                    tok_e, s_e = run_engine(engine, args.groups, args.n, args.max_tokens)
                    eng_rates.append(tok_e / s_e)
                else:
                    tok_d, s_d = run_direct(engine, client, args.groups, args.n, args.max_tokens)
                    dir_rates.append(tok_d / s_d)
            if tok_e != tok_d:
                print(f"warning: round {r}: engine generated {tok_e} tokens, direct {tok_d}")
            print(f"round {r}: engine {eng_rates[-1]:8.0f} tok/s   direct {dir_rates[-1]:8.0f} tok/s")
        e, d = statistics.median(eng_rates), statistics.median(dir_rates)
        print(f"\ngroups={args.groups} n={args.n} max_tokens={args.max_tokens} repeats={args.repeats}")
        print(f"VllmEngine.generate : {e:8.0f} generated tokens/s (median)")
        print(f"direct /v1/completions: {d:8.0f} generated tokens/s (median)")
        print(f"ratio engine/direct : {e / d:.3f}  (aim >= 0.95)")
        engine.close()
        client.close()
    finally:
        if server is not None:
            server.close()
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
