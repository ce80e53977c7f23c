"""README.md and docs/: a README a newcomer reads (short, every docs page linked from it), links and anchors that
resolve, the files and modules the pages name exist, and every benchmark figure they quote sits in a block that
bench/doc_figures.py checks against the command that produced it."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
# a path the pages name in backticks, from one of the project's top folders (a pattern with * or <...> is skipped)
PATH = re.compile(r"`((?:workers|events|workflows|schemas|tests|bench|examples|docs|\.ci)/[\w./-]*)(?![*<\w])")
# a module the pages name in backticks, dotted (rolledger.workers.roles.trainer, workflows.rank.may_take, ...)
MODULE = re.compile(r"`((?:rolledger\.)?(?:workers|events|workflows|schemas)(?:\.\w+)+)")


def _doc_figures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("doc_figures", ROOT / "bench" / "doc_figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves its annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def anchors(page: Path) -> set[str]:
    """The heading anchors GitHub gives a page: lower case, punctuation dropped, spaces as hyphens."""
    found: set[str] = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            found.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return found


def test_the_readme_is_under_250_lines_and_links_every_docs_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 250
    linked = {(README.parent / target.split("#")[0]).resolve() for target in LINK.findall(text)}
    assert [p.name for p in DOCS if p.resolve() not in linked] == []
    assert "./dev run" in text and "./dev test" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_files_and_modules_a_page_names_exist(page: Path) -> None:
    text = page.read_text()
    missing = [p for p in PATH.findall(text) if not (ROOT / p.rstrip(".")).exists()]
    for name in MODULE.findall(text):
        parts = name.removeprefix("rolledger.").split(".")
        # the longest prefix that is a module or package; what follows it is an attribute (a function, a class)
        if not any(
            (ROOT / Path(*parts[:k])).with_suffix(".py").is_file()
            or (ROOT / Path(*parts[:k]) / "__init__.py").is_file()
            for k in range(len(parts), 1, -1)
        ):
            missing.append(name)
    assert missing == []


def test_every_bench_block_of_the_docs_passes_its_check() -> None:
    assert _doc_figures().check() == []


def test_the_check_names_each_thing_wrong_with_a_block(tmp_path: Path) -> None:
    df = _doc_figures()
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "bench_x.py").write_text(
        "import argparse\nap = argparse.ArgumentParser()\nap.add_argument('--ranks', type=int)\n"
    )
    (tmp_path / "docs").mkdir()
    measured = "Measured: 2-core machine, shared; one run; recorded in commit abc1234 (2026-12-01)."
    (tmp_path / "README.md").write_text(
        f"<!-- bench: python bench/bench_x.py --ranks 2 -->\n{measured}\n1.0x\n<!-- /bench -->\n"
    )
    assert df.check(tmp_path) == []
    (tmp_path / "docs" / "p.md").write_text(
        f"<!-- bench: python bench/bench_x.py --reps 3 -->\n{measured}\n<!-- /bench -->\n"
        "<!-- bench: python bench/bench_x.py -->\nfigures with no word of where\n<!-- /bench -->\n"
        f"<!-- bench: python bench/bench_gone.py -->\n{measured}\n<!-- /bench -->\n"
        "<!-- bench: rolledger run -->\n<!-- /bench -->\n"
        "<!-- /bench -->\n"
        f"<!-- bench: python bench/bench_x.py -->\n{measured}\n"
    )
    problems = "\n".join(df.check(tmp_path))
    assert "p.md:1: bench/bench_x.py declares no --reps" in problems
    assert "p.md:4: the block's first line must say where and when" in problems
    assert "p.md:7: bench/bench_gone.py does not exist" in problems
    assert "p.md:10: the command must be `python bench/NAME.py [flags]`" in problems
    assert "p.md:12: <!-- /bench --> without an opening" in problems
    assert "p.md:13: bench block never closed" in problems
    assert df.main([]) == 0  # the repository's own pages
