"""The benchmark figures the docs quote, checked against the commands that produced them.

A page quotes a benchmark's figures inside a block that names the command, and says on its first line where and
when they were measured:

    <!-- bench: python bench/bench_transport.py --ranks 2 --reps 3 -->
    Measured: 2-core machine, shared; one run; recorded in commit f2024fd (2026-12-07).
    ... the figures ...
    <!-- /bench -->

`python bench/doc_figures.py` checks every block in README.md and docs/*.md: the markers pair up, the command runs a
script of bench/ that exists, every `--flag` the block names (in its command or its text) is one that script
declares, and the `Measured:` line names the cores and the commit. One line per problem, exit 1 (tests/test_docs.py
runs the same check). The figures are excerpts a person picks from a run's output, so they are updated by hand: with
`--rerun` each block's command runs again (from the repository's root, on this interpreter) and its output is
printed beside the figures the page quotes. The figures `./dev run` prints are a separate block of the README,
rewritten from a real run by bench/readme_figures.py.

    python bench/doc_figures.py                                  # check every block
    python bench/doc_figures.py --rerun --only bench_straggler   # run the matching blocks' commands again
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN = re.compile(r"<!-- bench: (?P<command>.+?) -->")
END = "<!-- /bench -->"
MEASURED = re.compile(r"^Measured: .*\bcores?\b.*\bcommit [0-9a-f]{7,40}\b")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@dataclass(frozen=True)
class Block:
    """One quoted set of figures: where it is, the command that produced it, and its text (markers excluded)."""

    page: Path
    line: int  # of the opening marker, 1-based
    command: str
    body: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page}:{self.line}"


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def blocks(page: Path, text: str) -> tuple[list[Block], list[str]]:
    """The page's blocks, and a line for each marker that does not pair up."""
    found: list[Block] = []
    problems: list[str] = []
    open_at: tuple[int, str] | None = None
    body: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        begin = BEGIN.search(line)
        if begin:
            if open_at is not None:
                problems.append(f"{page}:{number}: a bench block opens inside the one opened on line {open_at[0]}")
            open_at, body = (number, begin.group("command").strip()), []
        elif END in line:
            if open_at is None:
                problems.append(f"{page}:{number}: {END} without an opening <!-- bench: COMMAND -->")
            else:
                found.append(Block(page, open_at[0], open_at[1], "\n".join(body)))
                open_at = None
        elif open_at is not None:
            body.append(line)
    if open_at is not None:
        problems.append(f"{page}:{open_at[0]}: bench block never closed ({END})")
    return found, problems


def declared_flags(script: Path) -> set[str]:
    """Every `--flag` the script's argparse declares (string literals given to add_argument)."""
    flags: set[str] = set()
    for node in ast.walk(ast.parse(script.read_text(), str(script))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return {f for f in flags if f.startswith("--")} | {"--help"}


def script_of(block: Block, root: Path = ROOT) -> Path | None:
    """The bench/ script a block's command runs (`python bench/NAME.py ...`), or None if it names none."""
    words = shlex.split(block.command)
    if len(words) < 2 or words[0] != "python" or not re.fullmatch(r"bench/[\w-]+\.py", words[1]):
        return None
    return root / words[1]


def check_block(block: Block, root: Path = ROOT) -> Iterator[str]:
    """A line for each thing wrong with one block."""
    script = script_of(block, root)
    if script is None:
        yield f"{block.where}: the command must be `python bench/NAME.py [flags]`, not {block.command!r}"
        return
    if not script.is_file():
        yield f"{block.where}: {script.relative_to(root)} does not exist"
        return
    first = next((ln for ln in block.body.splitlines() if ln.strip()), "")
    if not MEASURED.match(first):
        yield (
            f"{block.where}: the block's first line must say where and when: "
            "'Measured: <N-core machine ...>; ...; commit <hash> ...'"
        )
    unknown = sorted(set(FLAG.findall(block.command + "\n" + block.body)) - declared_flags(script))
    if unknown:
        yield f"{block.where}: {script.relative_to(root)} declares no {', '.join(unknown)}"


def check(root: Path = ROOT) -> list[str]:
    """Every problem with every bench block of README.md and docs/ (empty: all well)."""
    problems: list[str] = []
    for page in pages(root):
        if not page.is_file():
            continue
        found, unpaired = blocks(page, page.read_text())
        problems += unpaired
        for block in found:
            problems += check_block(block, root)
    return problems


def rerun(block: Block, root: Path = ROOT) -> int:
    """Run the block's command again and print its output under the figures the page quotes."""
    words = shlex.split(block.command)
    print(f"== {block.where}: {block.command}\n-- quoted:\n{block.body}\n-- now:", flush=True)
    return subprocess.run([sys.executable, *words[1:]], cwd=root, check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rerun", action="store_true", help="run the blocks' commands again and print their output")
    ap.add_argument("--only", default="", help="with --rerun: only the blocks whose command contains this")
    args = ap.parse_args(argv)
    problems = check()
    for line in problems:
        print(f"doc_figures: {line}", file=sys.stderr)
    if problems:
        return 1
    if not args.rerun:
        count = sum(len(blocks(p, p.read_text())[0]) for p in pages() if p.is_file())
        print(f"doc_figures: {count} bench blocks checked, all well")
        return 0
    status = 0
    for page in pages():
        if page.is_file():
            for block in blocks(page, page.read_text())[0]:
                if args.only in block.command:
                    status = max(status, rerun(block))
    return status


if __name__ == "__main__":
    sys.exit(main())
