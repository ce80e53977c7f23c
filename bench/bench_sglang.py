"""Benchmark (run by hand): generated tokens/s through SglangEngine.generate vs direct /generate calls.

    .venv-sglang/bin/python bench/bench_sglang.py [--groups 20] [--n 8] [--max-tokens 48] [--repeats 5]
        [--temperature 1.0] [--concurrency 1] [--device cpu] [--url URL [--model-dir DIR]]

Starts one SGLang server on a free loopback port with the tiny policy (bf16, random; or --url: a running server
whose model directory this process can read, its own model_path or --model-dir), warms both paths up, then runs
`--repeats` rounds (alias `--runs`). A round sends `--groups` groups (prompt, n, sampling, per-group seed) in waves of
`--concurrency` in flight, and each wave goes through both paths, which one first alternating, so that load from
elsewhere on a shared machine hits both alike:

- engine: `SglangEngine.generate` (builds the body, posts it, checks every sample's weight_version, parses the
  samples into SampleOutput, keeps stats);
- direct: `httpx.Client.post("/generate", json=<the same body, from engine.generate_request, built beforehand>)`
  and a JSON decode, counting `output_ids`.

Prints one line per round (tokens, tokens/s of each path, their ratio), then a table of each path's median, min and
max tokens/s, and the ratio engine/direct: the median of the rounds' ratios (each round pairs the paths wave by
wave, so drift cancels; aim >= 0.95), then the ratio of the medians. At temperature > 0 the two paths do not
generate the same tokens: SGLang uses `sampling_seed` only with --enable-deterministic-inference (GPU attention
backends only), so sample lengths (EOS) differ, tokens/s is what is compared, and rounds vary more.
`--temperature 0` (greedy) makes both paths generate the same tokens. Where `sglang` is not installed in this
interpreter, it prints why in one line and exits 0 (the SGLang tier's environment has it: .venv-sglang/bin/python,
built by `bash .ci/sglang-tier.sh`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rolledger.schemas.config import ModelConfig, SamplingParams
from rolledger.workers.engines.server_process import ServerProcess
from rolledger.workers.engines.sglang_engine import SglangEngine
from rolledger.workers.engines.sglang_server import start_sglang_server

PROMPT = [1, 4, 5, 14, 6, 15]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sglang_missing() -> str | None:
    """Why this interpreter cannot run an SGLang server (None when it can: the package is installed)."""
    if importlib.util.find_spec("sglang") is None:
        return f"sglang is not installed in {sys.executable}"
    try:
        importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return f"sglang in {sys.executable} has no package metadata (not an installed distribution)"
    return None


def _sampling(g: int, args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=g)


def run_round(
    engine: SglangEngine, client: httpx.Client, pool: ThreadPoolExecutor, args: argparse.Namespace, first: int
) -> dict[str, tuple[int, float]]:
    """One round: the groups in waves of `concurrency` in flight, each wave through both paths one after the other
    (which goes first alternates), so load from elsewhere on a shared machine hits both. Per path: (tokens, seconds)."""
    bodies = [engine.generate_request(PROMPT, args.n, _sampling(g, args)) for g in range(args.groups)]

    def via_engine(g: int) -> int:
        out = engine.generate(PROMPT, args.n, _sampling(g, args))
        return sum(len(s.token_ids) for s in out.samples)

    def via_direct(g: int) -> int:
        resp = client.post("/generate", json=bodies[g])
        resp.raise_for_status()
        answer: Any = resp.json()
        items = answer if isinstance(answer, list) else [answer]
        return sum(len(it["output_ids"]) for it in items)

    calls: dict[str, Callable[[int], int]] = {"engine": via_engine, "direct": via_direct}
    tokens = dict.fromkeys(calls, 0)
    seconds = dict.fromkeys(calls, 0.0)
    for w, lo in enumerate(range(0, args.groups, args.concurrency)):
        wave = range(lo, min(lo + args.concurrency, args.groups))
        for path in ("engine", "direct") if (w + first) % 2 == 0 else ("direct", "engine"):
            t0 = time.perf_counter()
            tokens[path] += sum(pool.map(calls[path], wave))
            seconds[path] += time.perf_counter() - t0
    return {path: (tokens[path], seconds[path]) for path in calls}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=20, help="groups (requests of n samples) per path per round")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", "--runs", type=int, default=5, help="rounds of (engine, direct)")
    ap.add_argument("--temperature", type=float, default=1.0, help="0: greedy, both paths generate the same tokens")
    ap.add_argument("--concurrency", type=int, default=1, help="groups in flight at once, the same on both paths")
    ap.add_argument("--device", default="cpu", help="the server's --device when this script starts it (cpu, cuda)")
    ap.add_argument("--url", default=None, help="a running SGLang server instead of starting one")
    ap.add_argument("--model-dir", default=None, help="with --url: the server's model directory, if not its model_path")
    args = ap.parse_args()
    if args.concurrency < 1 or args.groups < 1 or args.repeats < 1:
        ap.error("--concurrency, --groups and --repeats must be >= 1")

    missing = sglang_missing()
    if missing:
        print(f"bench_sglang SKIPPED: {missing} (use .venv-sglang/bin/python; bash .ci/sglang-tier.sh creates it)")
        return 0

    server: ServerProcess | None = None
    model_dir: Path | None = None
    tmp = tempfile.TemporaryDirectory(prefix="rolledger-bench-sglang-")
    try:
        if args.url is None:
            from rolledger.workers.policy.policy_model import build_model, build_tokenizer, save_policy

            tok = build_tokenizer()
            model_dir = save_policy(
                Path(tmp.name) / "model", build_model(ModelConfig(dtype="bfloat16"), len(tok), 0), tok
            )
            server = start_sglang_server(
                model_dir, _free_port(), device=args.device, log_path=Path(tmp.name) / "sglang.log"
            )
            print(f"server ready in {server.start_s:.1f} s ({server.url})")
            url = server.url
        else:
            url = args.url
            model_dir = Path(args.model_dir) if args.model_dir else None
        engine = SglangEngine(url, rank=0, model_dir=model_dir, timeout_s=120)
        print(f"SGLang {engine.server_version} on {engine.device}")
        client = httpx.Client(base_url=url, timeout=120)  # the engine's own client has httpx's default limits too
        pool = ThreadPoolExecutor(max_workers=args.concurrency)
        warm = argparse.Namespace(**{**vars(args), "groups": min(3 * args.concurrency, args.groups)})
        run_round(engine, client, pool, warm, 0)  # warm-up both paths
        eng_rates: list[float] = []
        dir_rates: list[float] = []
        ratios: list[float] = []
        print(f"{'round':>5} {'engine tok':>10} {'tok/s':>8} {'direct tok':>10} {'tok/s':>8} {'ratio':>6}")
        for r in range(args.repeats):
            got = run_round(engine, client, pool, args, r)
            (tok_e, s_e), (tok_d, s_d) = got["engine"], got["direct"]
            eng_rates.append(tok_e / s_e)
            dir_rates.append(tok_d / s_d)
            ratios.append(eng_rates[-1] / dir_rates[-1])
            if args.temperature == 0 and tok_e != tok_d:
                print(f"warning: round {r}: greedy, yet engine generated {tok_e} tokens and direct {tok_d}")
            print(f"{r:>5} {tok_e:>10} {eng_rates[-1]:8.0f} {tok_d:>10} {dir_rates[-1]:8.0f} {ratios[-1]:6.3f}")
        e, d = statistics.median(eng_rates), statistics.median(dir_rates)
        print(
            f"\ngroups={args.groups} n={args.n} max_tokens={args.max_tokens} temperature={args.temperature} "
            f"repeats={args.repeats} concurrency={args.concurrency}"
        )
        print(f"{'path':<24} {'median tok/s':>12} {'min':>8} {'max':>8}")
        print(f"{'SglangEngine.generate':<24} {e:12.0f} {min(eng_rates):8.0f} {max(eng_rates):8.0f}")
        print(f"{'direct POST /generate':<24} {d:12.0f} {min(dir_rates):8.0f} {max(dir_rates):8.0f}")
        print(
            f"ratio engine/direct: {statistics.median(ratios):.3f} (median of the rounds' ratios, range "
            f"{min(ratios):.3f}-{max(ratios):.3f}; of the medians {e / d:.3f})  (aim >= 0.95)"
        )
        pool.shutdown()
        engine.close()
        client.close()
    finally:
        if server is not None:
            server.close()
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
