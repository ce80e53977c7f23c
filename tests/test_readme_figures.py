"""bench/readme_figures.py: the README's figures block rendered from summaries and put between its markers (the
run itself is `rolledger run`, exercised elsewhere)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "readme_figures.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_figures", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(reward_first: float, reward_last: float, events: int) -> dict[str, Any]:
    return {
        "steps": 40,
        "updates_committed": 40,
        "updates_aborted": 0,
        "reward_first": reward_first,
        "reward_last": reward_last,
        "max_lag": 1,
        "logprob_agreement": 1.04e-07,
        "engine_idle_fraction": 0.527,
        "anomalies": 0,
        "wall_s": 99.4,
        "events": events,
        "audit": "OK",
        "queue_check": {
            "predicted_mean_queue_groups": 4.86,
            "measured_mean_queue_groups": 4.89,
            "measured_max_queue_groups": 11.0,
            "throttle_cap_groups": 16.0,
        },
    }


def test_the_block_shows_the_summary_figures_and_the_spread_between_runs() -> None:
    rf = _script()
    one = rf.render_block([_summary(0.5367, 0.6451, 9148)], "a CPU, 2 cores")
    lines = one.splitlines()
    assert lines[0] == rf.BEGIN and lines[-1] == rf.END
    assert "reward_first -> reward_last  0.537 -> 0.645  (mean of the first/last 5 steps)" in lines
    assert "logprob_agreement  1e-07" in one and "engine_idle_fraction  0.53" in one
    assert "queue, groups  predicted mean 4.86, measured 4.89; max 11  (throttle cap 16)" in one
    assert "audit OK" in one and "one run; a CPU, 2 cores" in one
    two = rf.render_block([_summary(0.5367, 0.6451, 9148), _summary(0.478, 0.642, 9150)], "x")
    assert "0.478-0.537 -> 0.642-0.645" in two and "2 runs (ranges" in two and "9148-9150" in two


def test_the_block_replaces_only_what_lies_between_the_markers(tmp_path: Path) -> None:
    rf = _script()
    text = f"intro\n{rf.BEGIN}\nold figures\n{rf.END}\nafter\n"
    block = rf.render_block([_summary(0.5, 0.6, 10)], "x")
    assert rf.replace_block(text, block) == f"intro\n{block}\nafter\n"
    with pytest.raises(rf.MarkersMissing, match="figures:begin"):
        rf.replace_block("no markers here", block)
    readme = tmp_path / "README.md"
    readme.write_text(text)
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps(_summary(0.5, 0.6, 10)))
    assert rf.main(["--summary", str(summary), "--write", "--readme", str(readme)]) == 0
    assert "0.500 -> 0.600" in readme.read_text() and readme.read_text().startswith("intro\n")
    readme.write_text("no markers")
    assert rf.main(["--summary", str(summary), "--write", "--readme", str(readme)]) == 2
