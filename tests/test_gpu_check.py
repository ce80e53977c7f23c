"""bench/gpu_check.py on a machine without a GPU: one line saying it checks nothing, exit 0, within seconds; a bad
argument is one line and exit 2; `--dry-run-on-cpu` runs the same steps on the CPU. (On a GPU it runs the CUDA
checks; its figures go in docs/performance.md.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this is the no-GPU behaviour; a GPU runs the real checks")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    assert lines[0].startswith("gpu_check: no CUDA device here") and "nothing checked" in lines[0]
    assert done.stderr == ""


def test_a_bad_argument_is_one_line_and_exit_2() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--deadline-s", "900"], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stdout.splitlines() == ["gpu_check: --deadline-s must be in (0, 480] and --layers >= 1"]
    assert "Traceback" not in done.stderr


def test_the_same_steps_run_on_the_cpu_in_a_dry_run() -> None:
    """What runs on the GPU, run on the CPU (no memory figures): the engine generates, sleeps and wakes, the trained
    weights are checked in another process and a corrupted tensor refused by name, the commit's digest matches."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run-on-cpu", "--layers", "1"],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "bad=None" in out
    assert "digest matches" in out
    refused = next(line for line in out.splitlines() if line.startswith("ipc: a corrupted "))
    name = refused.removeprefix("ipc: a corrupted ").split(" was refused at ")
    assert name[0] == name[1]
    assert out.splitlines()[-1] == "gpu_check: ok"
