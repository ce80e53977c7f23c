"""A rank worker process whose torch engine takes DELAY_S seconds longer per group (the heartbeat tests,
tests/test_heartbeats.py): the group is in flight, its entry pending, for as long as the test needs to SIGSTOP it.

Usage: python tests/_slow_rank_proc.py URL RUN_ID RANK NAME DELAY_S
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slow_engine import SlowEngine

from rolledger.events.connection import connect
from rolledger.workers.engines.torch_engine import TorchEngine
from rolledger.workers.operator.processes import _run_started, _serve
from rolledger.workers.policy.policy_model import load_policy
from rolledger.workers.roles.rank import RankWorker


def main(url: str, run_id: str, rank: int, name: str, delay_s: float) -> int:
    client = connect(url)
    started = _run_started(client, run_id)
    model, tokenizer = load_policy(Path(started.model_dir))
    engine = SlowEngine(TorchEngine(model, tokenizer, rank=rank), delay_s)
    worker = RankWorker(client, run_id, rank, engine)
    worker.name = name
    return _serve(worker)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])))
