"""The prepared GPU check: the CUDA paths nothing on a CPU can run, in one command of at most --deadline-s (480) s.

    python bench/gpu_check.py [--deadline-s 480] [--layers 8]

On a machine without a CUDA device it prints one line saying so and exits 0 (it checks nothing). On one GPU:

  1. engine     the torch engine (workers/engines/torch_engine.py) on `cuda`, generating greedily from a ~0.5 GB fp32
                Qwen2-shaped policy the project builds itself (no download)
  2. colocated  sleep(1) -> train -> wake on the same device: the memory the engine released and retook measured by
                `torch.cuda.mem_get_info` (workers/engines/torch_memory.device_used_bytes), and a training step run
                in the memory the engine gave back
  3. ipc        the trained weights handed to another process as CUDA IPC handles (torch.multiprocessing), which
                checks every tensor against the manifest (workers/staging_store.build_manifest: xxh3-128 per tensor)
                before the engine commits them; one tensor corrupted on the way must be refused by name
  4. commit     the engine stages and commits what was verified, its live digest equals the manifest's, and it
                generates again

It needs torch with CUDA and the project's dependencies (`pip install -e .`, or the wheels carried with it); a
missing one is one line and exit 2. Each figure is one line; exit 1 when a check fails, 0 when all pass.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NO_GPU = "gpu_check: no CUDA device here"


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / (1 << 20):.0f} MiB"


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.seconds = seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def check(self, what: str) -> None:
        if self.left() <= 0:
            raise TimeoutError(f"past the {self.seconds:g} s deadline before {what}")


def _verify_in_child(queue: Any, results: Any, device_type: str) -> None:
    """Another process: takes CUDA tensors (IPC handles) and a manifest, checks every tensor against it."""
    from rolledger.schemas.weights import WeightManifest
    from rolledger.workers.weights.staging_checksums import checksum

    for _ in range(2):
        tensors, manifest_json = queue.get(timeout=120)
        manifest = WeightManifest.model_validate_json(manifest_json)
        bad = None
        for e in manifest.tensors:
            t = tensors[e.name]
            if (
                t.device.type != device_type
                or tuple(t.shape) != e.shape
                or checksum(t, manifest.checksum_algo) != e.checksum
            ):
                bad = e.name
                break
        results.put(bad)
        del tensors


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drop_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> int:
    """The checks on `args.device` ("cuda", or "cpu" for --dry-run-on-cpu: the same steps, no memory figures)."""
    deadline = Deadline(args.deadline_s)
    try:
        import torch.multiprocessing as mp

        from rolledger.schemas.config import ModelConfig, SamplingParams
        from rolledger.workers.engines import torch_memory
        from rolledger.workers.engines.torch_engine import TorchEngine
        from rolledger.workers.policy.policy_model import build_model, build_tokenizer, policy_state
        from rolledger.workers.weights.staging_store import build_manifest, prepare_for_save
    except ImportError as e:
        print(f"gpu_check: a dependency is missing ({e}); install the project first: pip install -e .")
        return 2
    if args.dry_run_on_cpu:
        device = torch.device("cpu")
        print(f"gpu_check: dry run on the CPU (torch {torch.__version__}): no memory figures")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        print(f"gpu_check: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    failures: list[str] = []
    cfg = ModelConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=args.layers,
        num_attention_heads=16,  # the project's policies take 64-wide heads
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    tok = build_tokenizer()
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    prompt = tok("12+34=")["input_ids"]

    # 1. the engine generating on CUDA
    t0 = time.perf_counter()
    engine = TorchEngine(build_model(cfg, len(tok), 0), tok, device=str(device), prefix_cache=False)
    out = engine.generate(prompt, 2, greedy)
    tokens = [len(s.token_ids) for s in out.samples]
    print(f"engine: generated {tokens} tokens greedily on {device} in {time.perf_counter() - t0:.2f} s")
    if not all(tokens):
        failures.append("engine: generated nothing")
    weight_bytes = engine.accounted_bytes()
    deadline.check("the colocated cycle")

    # 2. colocated: sleep -> train in the memory given back -> wake
    _sync(device)
    before = torch_memory.device_used_bytes(device)
    report = engine.sleep(1)
    _sync(device)
    slept = torch_memory.device_used_bytes(device)
    released = None if before is None or slept is None else before - slept
    print(
        f"colocated: sleep(1) released {_mib(released)} of the device per mem_get_info "
        f"(engine accounting: {_mib(report.bytes_freed)}, verified={report.verified})"
    )
    if not report.verified:
        failures.append("colocated: the engine's sleep report is not verified")
    if released is not None and released < 0.9 * report.bytes_freed:
        failures.append(f"colocated: the device got back {_mib(released)}, the engine says {_mib(report.bytes_freed)}")
    trainer_model: Any = build_model(cfg, len(tok), 0)
    trainer_model = trainer_model.to(device).train()
    opt = torch.optim.SGD(trainer_model.parameters(), lr=1e-3)
    ids = torch.tensor([prompt * 4], device=device)
    t0 = time.perf_counter()
    loss = trainer_model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    _sync(device)
    training = torch_memory.device_used_bytes(device)
    print(
        f"colocated: one training step in {time.perf_counter() - t0:.2f} s, device at {_mib(training)} while training"
    )
    trained = {n: t.detach().clone() for n, t in policy_state(trainer_model).items()}
    del trainer_model, opt, loss
    _drop_cache(device)
    deadline.check("the wake")
    woke_from = torch_memory.device_used_bytes(device)
    engine.wake(["weights", "kv_cache"])
    _sync(device)
    woke = torch_memory.device_used_bytes(device)
    retaken = None if woke is None or woke_from is None else woke - woke_from
    print(f"colocated: wake retook {_mib(retaken)} of the device (released {_mib(released)})")
    if retaken is not None and released is not None and retaken < 0.9 * released:
        failures.append(f"colocated: wake retook {_mib(retaken)}, sleep released {_mib(released)}")

    # 3. a CUDA-IPC update verified against its manifest in another process
    deadline.check("the CUDA IPC update")
    manifest = build_manifest(prepare_for_save(trained, 1), 1, 0, "xxh3_128")  # checksums of the host bytes
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_verify_in_child, args=(queue, results, device.type), daemon=True)
    child.start()
    t0 = time.perf_counter()
    queue.put((trained, manifest.model_dump_json()))
    bad = results.get(timeout=max(deadline.left(), 1.0))
    print(
        f"ipc: {len(trained)} {device.type} tensors checked in another process in {time.perf_counter() - t0:.2f} s: {bad=}"
    )
    if bad is not None:
        failures.append(f"ipc: the intact update was refused at {bad}")
    name = manifest.tensors[len(manifest.tensors) // 2].name
    corrupt = dict(trained)
    corrupt[name] = trained[name].clone()
    corrupt[name].view(-1)[0] += 1
    queue.put((corrupt, manifest.model_dump_json()))
    refused = results.get(timeout=max(deadline.left(), 1.0))
    print(f"ipc: a corrupted {name} was refused at {refused}")
    if refused != name:
        failures.append(f"ipc: the corrupt update was refused at {refused}, not {name}")
    child.join(timeout=30)

    # 4. commit what was verified
    deadline.check("the commit")
    engine.stage_weights(1, trained)
    commit = engine.commit_weights(1)
    if commit.weights_digest != manifest.weights_digest:
        failures.append(f"commit: live digest {commit.weights_digest} != manifest {manifest.weights_digest}")
    again = engine.generate(prompt, 1, greedy)
    print(
        f"commit: v1 live, digest {'matches' if commit.weights_digest == manifest.weights_digest else 'DIFFERS'}; "
        f"generated {len(again.samples[0].token_ids)} tokens after; weights {_mib(weight_bytes)}"
    )
    engine.close()
    for f in failures:
        print(f"gpu_check: FAILED {f}")
    print(f"gpu_check: {'ok' if not failures else f'{len(failures)} check(s) failed'}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deadline-s", type=float, default=480.0, help="stop (exit 1) past this many seconds")
    ap.add_argument("--layers", type=int, default=8, help="layers of the policy (8: ~0.5 GB in fp32)")
    ap.add_argument(
        "--dry-run-on-cpu",
        action="store_true",
        help="run the same steps on the CPU (no memory figures; IPC through shared memory): tests the script itself",
    )
    args = ap.parse_args(argv)
    if not 0 < args.deadline_s <= 480 or args.layers < 1:
        print("gpu_check: --deadline-s must be in (0, 480] and --layers >= 1")
        return 2
    if not torch.cuda.is_available() and not args.dry_run_on_cpu:
        print(f"{NO_GPU} (torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}): nothing checked")
        return 0
    try:
        return run(args)
    except TimeoutError as e:
        print(f"gpu_check: FAILED {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
