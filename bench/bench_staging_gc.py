"""How many staged versions a long run keeps on disk: a real `rolledger run` (embedded Redis, torch engine), its
staging directory sampled every 50 ms from outside while it runs.

The trainer collects, before it stages each version, every version no rank or restart can need again
(`workflows.trainer.versions_to_keep`: the published one, the trainer's last, an update still open), so at most
three are ever on disk, whatever the number of steps. This prints the most seen at once, how many are left at the
end, and the peak bytes of the whole directory, beside the number a run without collection would keep (one per
version).

    python bench/bench_staging_gc.py [--steps 200] [--transport directory|dist] [--ranks 2]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VERSION_DIR = re.compile(r"^v(\d{6})-[0-9a-f]{12}$")


def sample(staging: Path) -> tuple[set[int], int]:
    """The versions on disk now, and the bytes of everything in the directory: versions, unfinished writes and the
    dist store's free file (the next version's file, kept from a collected one). An entry may vanish while read."""
    versions: set[int] = set()
    size = 0
    try:
        entries = list(staging.iterdir())
    except FileNotFoundError:
        return versions, 0
    for p in entries:
        if m := VERSION_DIR.match(p.name):
            versions.add(int(m.group(1)))
        try:
            size += sum(f.stat().st_size for f in p.iterdir()) if p.is_dir() else p.stat().st_size
        except FileNotFoundError:
            pass
    return versions, size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--transport", choices=("directory", "dist"), default="dist")
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rolledger-gc-") as tmp:
        runs = Path(tmp)
        run_id = f"gc-{args.transport}"
        staging = runs / run_id / "staging"
        cmd = [
            str(Path(sys.executable).parent / "rolledger"),
            "run",
            "--steps",
            str(args.steps),
            "--ranks",
            str(args.ranks),
            "--transport",
            args.transport,
            "--run-id",
            run_id,
            "--runs-dir",
            str(runs),
        ]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        most, peak_bytes, seen, samples = 0, 0, set(), 0
        while proc.poll() is None:
            versions, size = sample(staging)
            most, peak_bytes = max(most, len(versions)), max(peak_bytes, size)
            seen |= versions
            samples += 1
            time.sleep(0.05)  # a sampling period, not a synchronisation: the run does not wait for us
        err = proc.stderr.read() if proc.stderr else ""
        if proc.returncode != 0:
            print(err[-2000:], file=sys.stderr)
            print(f"the run exited {proc.returncode}", file=sys.stderr)
            return 1
        left, left_bytes = sample(staging)
        print(
            f"{args.steps} steps, {args.ranks} ranks, transport {args.transport}: {time.monotonic() - t0:.0f} s, "
            f"{samples} samples of the staging directory\n"
            f"  versions staged during the run        {len(seen)} seen (a run without collection keeps them all)\n"
            f"  most on disk at once                  {most}  (peak {peak_bytes / 1e6:.2f} MB)\n"
            f"  left at the end                       {len(left)}  {sorted(left)}  ({left_bytes / 1e6:.2f} MB)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
