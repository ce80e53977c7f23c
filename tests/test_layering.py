"""The layers import only downwards, checked by an AST scan of every module (imports inside functions and
`if TYPE_CHECKING:` blocks included, relative imports resolved, `importlib.import_module("...")` and `__import__`
with a constant name too):

- `workflows/` (pure functions: the reducer and every decider) does no I/O and reads no clock or random source, so
  it imports no redis, rich, rolledger.workers, rolledger.events, time, datetime, random, secrets, uuid, os,
  socket, httpx or torch (nor the file, process and drawing libraries listed below);
- `schemas/` (the models) imports no torch, clock, random source, os, redis, nor any layer above it;
- `events/` (the log on Redis) imports neither rolledger.workers nor rolledger.workflows;
- inside `workers/` the sub-packages import only downwards, in the order runtime < policy < weights < engines <
  roles < operator (each package's `__init__` says what it may import).

A failure names every offending module, line and import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_ABOVE = ("rolledger.workers", "rolledger.events", "rolledger.workflows")

FORBIDDEN: dict[str, tuple[str, ...]] = {
    "workflows": (
        "redis",
        "rich",
        "rolledger.workers",
        "rolledger.events",
        "time",
        "datetime",
        "random",
        "secrets",
        "uuid",
        "os",
        "socket",
        "httpx",
        "torch",
        # and the rest of what would make a decision depend on more than its arguments: files, processes, drawing
        "pathlib",
        "shutil",
        "tempfile",
        "subprocess",
        "threading",
        "multiprocessing",
        "asyncio",
        "urllib",
        "http",
        "matplotlib",
    ),
    "schemas": (
        "torch",
        "time",
        "datetime",
        "random",
        "secrets",
        "uuid",
        "os",
        "socket",
        "threading",
        "redis",
        "httpx",
        *_ABOVE,
    ),
    "events": ("rolledger.workers", "rolledger.workflows"),
}


# workers/ sub-packages, lowest first: each may import those before it, none after it
WORKER_ORDER = ("runtime", "policy", "weights", "engines", "roles", "operator")
for _i, _pkg in enumerate(WORKER_ORDER):
    FORBIDDEN[f"workers/{_pkg}"] = tuple(f"rolledger.workers.{above}" for above in WORKER_ORDER[_i + 1 :])


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, dotted module name) of every import in `source`, the source of module `module`."""
    package = module if is_package else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            out.append((node.lineno, base))
            out.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value))
    return out


def _matches(name: str, banned: str) -> bool:
    return name == banned or name.startswith(banned + ".")


def violations(layer: str, rel: str, source: str) -> list[str]:
    """'path:line imports NAME (LAYER/ must not import BANNED)' for every forbidden import of one module."""
    parts = Path(rel).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    module = ".".join(("rolledger", *(parts[:-1] if is_package else parts)))
    found: dict[tuple[int, str], str] = {}
    for line, name in imported_modules(source, module, is_package):
        for banned in FORBIDDEN[layer]:
            if _matches(name, banned):
                found.setdefault((line, banned), f"{rel}:{line} imports {name} ({layer}/ must not import {banned})")
    return list(found.values())


def modules(layer: str) -> list[Path]:
    return sorted(p for p in (ROOT / "rolledger" / layer).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_the_layer_imports_nothing_it_must_not(layer: str) -> None:
    files = modules(layer)
    assert files, f"no modules found under {ROOT / layer}"
    bad = [v for p in files for v in violations(layer, str(p.relative_to(ROOT / "rolledger")), p.read_text())]
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("layer", "rel", "source", "named"),
    [
        ("workflows", "workflows/x.py", "import time\n", "workflows/x.py:1 imports time"),
        ("workflows", "workflows/x.py", "def f():\n    import os.path\n", "workflows/x.py:2 imports os.path"),
        ("workflows", "workflows/x.py", "from rolledger.events.store import EventLog\n", "imports rolledger.events"),
        ("workflows", "workflows/x.py", "from ..workers import faults\n", "imports rolledger.workers"),
        ("workflows", "workflows/x.py", "from rolledger import workers\n", "imports rolledger.workers"),
        (
            "workflows",
            "workflows/x.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import redis\n",
            ":3",
        ),
        ("workflows", "workflows/x.py", "import importlib\nm = importlib.import_module('torch')\n", "imports torch"),
        ("schemas", "schemas/x.py", "import torch.nn\n", "schemas/x.py:1 imports torch.nn"),
        ("schemas", "schemas/x.py", "from . import weights\nfrom ..workflows import reducer\n", "rolledger.workflows"),
        ("events", "events/x.py", "from rolledger.workflows.state import RunState\n", "imports rolledger.workflows"),
        (
            "workers/weights",
            "workers/weights/x.py",
            "from rolledger.workers.roles.trainer_client import restore\n",
            "workers/weights/ must not import rolledger.workers.roles",
        ),
        ("workers/runtime", "workers/runtime/x.py", "from ..policy import tasks\n", "imports rolledger.workers.policy"),
    ],
)
def test_the_scan_names_the_module_and_the_import(layer: str, rel: str, source: str, named: str) -> None:
    found = violations(layer, rel, source)
    assert len(found) == 1 and named in found[0], found


@pytest.mark.parametrize(
    ("layer", "source"),
    [
        ("workflows", "import math\nimport timeit_not_time\nfrom rolledger.schemas import events\n"),
        ("workflows", "from rolledger.workflows.state import RunState\nimport ostree_like\n"),
        ("schemas", "from pathlib import Path\nfrom rolledger.schemas.base import Model\n"),
        ("events", "import redis\nimport time\nfrom rolledger.schemas.events import Event\n"),
    ],
)
def test_allowed_imports_pass(layer: str, source: str) -> None:
    assert violations(layer, f"{layer}/x.py", source) == []


TRANSITIVE: dict[str, tuple[str, ...]] = {
    "workflows": ("torch", "redis", "rich", "matplotlib", "httpx", "rolledger.workers", "rolledger.events"),
    "schemas": ("torch", "redis", "rich", "matplotlib", "httpx", *_ABOVE),
    "events": ("torch", "rolledger.workers", "rolledger.workflows"),
}


@pytest.mark.parametrize("layer", sorted(TRANSITIVE))
def test_importing_a_layer_loads_nothing_it_must_not_even_indirectly(layer: str) -> None:
    """Import every module of the layer in a fresh interpreter: nothing banned may end up in sys.modules."""
    names = []
    for p in modules(layer):
        parts = p.relative_to(ROOT / "rolledger").with_suffix("").parts
        names.append(".".join(("rolledger", *(parts[:-1] if parts[-1] == "__init__" else parts))))
    code = (
        "import importlib, sys\n"
        f"for n in {names!r}: importlib.import_module(n)\n"
        f"print(sorted(m for m in sys.modules if any(m == b or m.startswith(b + '.') for b in {TRANSITIVE[layer]!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing {layer}/ loads: {done.stdout.strip()}"


def test_workers_holds_sub_packages_only() -> None:
    """`ls workers/` shows the architecture: the sub-packages of WORKER_ORDER and the package's own `__init__`."""
    entries = sorted(p.name for p in (ROOT / "rolledger" / "workers").iterdir() if p.name != "__pycache__")
    assert entries == sorted(("__init__.py", *WORKER_ORDER)), entries
    for pkg in WORKER_ORDER:
        doc = ast.get_docstring(ast.parse((ROOT / "rolledger" / "workers" / pkg / "__init__.py").read_text()))
        assert doc and "May import" in doc, f"workers/{pkg}/__init__.py must say what the package may import"


MAX_LINES = 500


def test_no_module_is_over_500_lines_without_saying_why() -> None:
    """A module over 500 lines says, in the first lines of its docstring, that it is "one concept" that reads better
    whole; every other module is split by concern."""
    long = []
    for p in sorted((ROOT / "rolledger").rglob("*.py")):
        if "__pycache__" in p.parts:
            continue
        text = p.read_text()
        if text.count("\n") <= MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if "one concept" not in " ".join(doc.splitlines()[:6]):
            long.append(f"{p.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert not long, "modules over 500 lines that do not say why they are one concept:\n" + "\n".join(long)
