"""compose.yaml: the services a GPU deployment needs, vLLM kept off published ports, and commands that fit the CLI."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(
    r"^rolledger (?:coordinator|worker (?P<kind>rollout|reward|trainer|rank)) --redis (?P<url>redis://\S+) "
    r"--run (?P<run>\S+)$"
)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


def _command(service: dict[str, Any]) -> str:
    cmd = service.get("command")
    return " ".join(cmd) if isinstance(cmd, list) else str(cmd)


def test_services_present(compose: dict[str, Any]) -> None:
    assert {"redis", "vllm", "driver", "coordinator", "reward", "trainer", "rank"} <= set(compose["services"])
    # one process per inference rank does both rollout and the rank agent's part: no second rank-0 worker
    assert "rollout" not in compose["services"]


def test_redis_has_aof_on(compose: dict[str, Any]) -> None:
    cmd = _command(compose["services"]["redis"])
    assert re.search(r"--appendonly yes\b", cmd), cmd
    assert "ports" not in compose["services"]["redis"]


def test_vllm_only_on_internal_networks(compose: dict[str, Any]) -> None:
    vllm = compose["services"]["vllm"]
    assert "ports" not in vllm, "vLLM's RL routes are unauthenticated: never publish its port"
    assert vllm.get("network_mode") is None
    nets = vllm.get("networks")
    assert nets, "vLLM must be attached to an explicit (internal) network, not the default bridge"
    for net in nets:
        assert compose["networks"][net].get("internal") is True, f"network {net!r} of vllm is not internal"


def test_vllm_runs_dev_mode_with_the_extension(compose: dict[str, Any]) -> None:
    vllm = compose["services"]["vllm"]
    assert str(vllm["environment"]["VLLM_SERVER_DEV_MODE"]) == "1"
    assert "vllm/vllm-openai" in vllm["build"]["dockerfile_inline"]
    args = vllm["command"]
    i = args.index("--worker-extension-cls")
    module, _, cls = args[i + 1].rpartition(".")
    # the class path names a real class in this repository (checked without importing vLLM)
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    assert cls in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    assert "0.0.0.0" in args  # inside the container; reachable only from the internal network


@pytest.mark.parametrize("name", ["coordinator", "reward", "trainer", "rank"])
def test_commands_fit_the_cli_contract(compose: dict[str, Any], name: str) -> None:
    service = compose["services"][name]
    m = COMMAND.match(_command(service))
    assert m, f"{name}: {_command(service)!r} is not `rolledger coordinator|worker KIND --redis URL --run RUN`"
    assert (m.group("kind") or "coordinator") == name
    host = re.match(r"redis://([^:/]+)", m.group("url"))
    assert host and host.group(1) in compose["services"], f"{name}: redis host is not a compose service"
    for net in service["networks"]:
        assert compose["networks"][net].get("internal") is True


def test_trainer_and_vllm_share_the_staging_volume(compose: dict[str, Any]) -> None:
    trainer_mounts = compose["services"]["trainer"]["volumes"]
    vllm_mounts = compose["services"]["vllm"]["volumes"]
    assert "staging:/staging" in trainer_mounts
    assert "staging:/staging:ro" in vllm_mounts  # the ranks only read staged updates


def test_driver_starts_the_run_with_a_config_that_fits(compose: dict[str, Any]) -> None:
    from rolledger.schemas.config import RunConfig
    from rolledger.workers.operator.cli_parser import build_parser

    cmd = compose["services"]["driver"]["command"]
    assert cmd[0] == "rolledger"
    args = build_parser().parse_args([c.replace("${RUN_ID:-run-1}", "run-1") for c in cmd[1:]])
    assert args.command == "run" and args.external_workers and args.model_dir == "/models/policy"
    cfg = RunConfig.load(ROOT / args.config.removeprefix("/app/"))
    assert cfg.engine == "vllm" and str(cfg.update.staging_dir) == "/staging"
    assert len(cfg.vllm_urls) == cfg.ranks == 1 and cfg.vllm_urls[0].startswith("http://vllm:")
    for name in ("driver", "coordinator", "reward", "trainer", "rank"):
        assert "./models:/models:ro" in compose["services"][name]["volumes"]
