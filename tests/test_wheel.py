"""The wheel: built from the checkout (offline, no build isolation), it holds only the `rolledger` package and its
dist-info; installed on its own it imports as `rolledger.*`, and the source tree's top-level folder names
(`schemas`, `workflows`, ...) are not importable from it.

The build runs on a copy of the installable files (symlinks kept as links, as in the checkout), so it never
writes build/ or *.egg-info into the working tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a wheel build and an install: about 10 s on a shared machine

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "rolledger", "schemas", "events", "workflows", "workers")
LAYERS = ("schemas", "events", "workflows", "workers")


def _run(
    cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir() and not path.is_symlink():
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name, follow_symlinks=False)
    out = tmp_path_factory.mktemp("dist")
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out)]
    _run([*pip, "."], cwd=src)
    (built,) = out.glob("rolledger-*.whl")
    return built


def test_the_wheel_holds_only_the_rolledger_package_and_its_dist_info(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"rolledger", wheel.name.split("-py")[0] + ".dist-info"}, sorted(tops)
    for layer in LAYERS:  # every layer's modules are in, as files under rolledger/
        for path in (ROOT / layer).rglob("*.py"):
            if "__pycache__" not in path.parts:
                assert f"rolledger/{path.relative_to(ROOT).as_posix()}" in names, path
    assert "rolledger/workers/operator/ui_page.html" in names  # package data: the page `rolledger ui` serves
    assert "rolledger/workers/engines/sglang_cpu_standin/sgl_kernel/__init__.py" in names  # the CPU stand-in


def test_installed_alone_it_imports_as_rolledger_and_not_as_top_level_folders(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # -S: no site-packages processing, so this checkout's editable-install hook (a .pth file) is not loaded; the
    # dependencies (pydantic, msgpack, ...) come from the environment's site-packages as a plain path, after the
    # installed wheel.
    deps = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(target), *deps])
    code = (
        "import importlib, sys\n"
        "import rolledger.workflows.reducer as r\n"
        f"assert r.__file__.startswith({str(target)!r}), r.__file__\n"
        f"for name in {LAYERS!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    sys.exit(f'top-level {name} is importable')\n"
        "from rolledger.workers.operator.ui_server import page_html\n"
        "assert '<script>' in page_html()\n"
        "print('ok')\n"
    )
    done = _run([sys.executable, "-S", "-c", code], cwd=elsewhere, env=env)
    assert done.stdout.strip() == "ok"
