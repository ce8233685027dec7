"""Fenced code blocks of the README and docs/**/*.md, for the tests that run them as a user would."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[2]
DEV = ROOT / "dev"
# every page under docs/, topic pages in subdirectories (docs/offload/*.md, docs/planner/*.md) included
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# The first line of a Python block that runs on several ranks says how to run it, e.g.
# "# run on 2 ranks: ./dev launch -n 2 snippet.py"; a block without it runs with ./dev python.
RANKS_MARKER = re.compile(r"^# run on (\d+) ranks: \./dev launch -n (\d+) \S+\.py\s*$")
_FENCE = re.compile(r"^```(\S*)\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def ranks(self) -> Optional[int]:
        """The number of ranks the block's marker names; None without a marker."""
        first = self.text.splitlines()[0] if self.text else ""
        found = RANKS_MARKER.match(first)
        if found is None:
            if "./dev launch" in first:
                raise ValueError(f"{self.where}: malformed ranks marker {first!r}")
            return None
        if found.group(1) != found.group(2):
            raise ValueError(f"{self.where}: marker names {found.group(1)} and {found.group(2)} ranks")
        return int(found.group(1))


def blocks(page: Path) -> List[Block]:
    """Every fenced block of ``page`` in order."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if end == len(lines):
            raise ValueError(f"{page}:{i + 1}: unclosed code fence")
        out.append(Block(page, i + 1, fence.group(1), "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return out


def python_blocks() -> List[Block]:
    return [b for page in PAGES for b in blocks(page) if b.lang == "python"]


def python_block_names() -> List[tuple]:
    """``(name, block)`` with names like ``docs/planner.md#2`` (the page's 2nd Python block): a name
    that survives edits above the block, unlike its line number."""
    out, seen = [], {}
    for block in python_blocks():
        page = str(block.page.relative_to(ROOT))
        seen[page] = seen.get(page, 0) + 1
        out.append((f"{page}#{seen[page]}", block))
    return out


def shell_commands(page: Path) -> List[tuple]:
    """``(block, command)`` for every command line of the page's ``bash`` / ``sh`` / ``console`` blocks;
    comments after ``#`` are dropped; ``$ `` prompts are removed (and then only prompted lines count)."""
    out = []
    for block in blocks(page):
        if block.lang not in ("bash", "sh", "console"):
            continue
        lines = block.text.splitlines()
        prompted = any(line.startswith("$ ") for line in lines)
        for line in lines:
            if prompted:
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command and not command.startswith("#"):
                out.append((block, command))
    return out
