"""``shardkit port [--write] FILE...``: rewrite a program's torchrec and fbgemm_gpu imports to shardkit's.

Only import statements change, and in them only the module names (plus an ``as`` that keeps the
name the program uses bound); every other character of the file stays as it is. torchrec's module
tree is shardkit's with another top-level name (docs/names.md), so:

==========================================  ==========================================================
``from torchrec.X import A``                ``from shardkit.X import A``
``from fbgemm_gpu.X import A``              ``from shardkit.fbgemm_gpu.X import A``
``import torchrec.X as t``                  ``import shardkit.X as t``
``import torchrec``                         ``import shardkit as torchrec``
``import torchrec.X``                       ``import shardkit.X, shardkit as torchrec`` (binds
                                            ``shardkit`` too)
``import fbgemm_gpu``                       ``import shardkit.fbgemm_gpu as fbgemm_gpu``
==========================================  ==========================================================

A file that calls ``torch.ops.fbgemm.*`` (ops that importing torchrec or fbgemm_gpu loads) gets
``; import shardkit.fbgemm_gpu.torch_ops`` after its first rewritten import, which defines them.
Relative imports and other modules are left alone. The unified diff of each file goes to stdout;
``--write`` also writes the files. Exit code 0, or 1 when a file cannot be read or parsed (named).
"""

from __future__ import annotations

import ast
import difflib
import re
import sys
from typing import List, Optional, Tuple

PROG = "shardkit port"
USAGE = "shardkit port [--write] FILE [FILE ...]"

# the top-level names a program imports -> the shardkit module at their place
_TARGETS = {"torchrec": "shardkit", "fbgemm_gpu": "shardkit.fbgemm_gpu"}
OPS_IMPORT = "import shardkit.fbgemm_gpu.torch_ops"


def _mapped(dotted: str) -> Optional[str]:
    top, dot, rest = dotted.partition(".")
    return _TARGETS[top] + dot + rest if top in _TARGETS else None


def _alias_text(alias: ast.alias) -> str:
    """An ``import`` clause rewritten (``alias`` of a torchrec / fbgemm_gpu module)."""
    new = _mapped(alias.name)
    if alias.asname is not None:
        return f"{new} as {alias.asname}"
    top = alias.name.partition(".")[0]
    if "." not in alias.name:
        return f"{new} as {top}"
    return f"{new}, {_TARGETS[top]} as {top}"


class _Edits:
    """Replacements ``(line, col_start, col_end, text)`` on the source's lines (0-based line, columns
    in characters of that line)."""

    def __init__(self, lines: List[str]) -> None:
        self.lines = lines
        self.edits: List[Tuple[int, int, int, str]] = []

    def apply(self) -> str:
        lines = list(self.lines)
        for line, start, end, text in sorted(self.edits, reverse=True):
            lines[line] = lines[line][:start] + text + lines[line][end:]
        return "".join(lines)


def _byte_col_to_char(line: str, col: int) -> int:
    return len(line.encode("utf-8")[:col].decode("utf-8", errors="replace"))


def _find_name(lines: List[str], node: ast.stmt, name: str, start_after: Tuple[int, int]) -> Tuple[int, int]:
    """Where the dotted ``name`` (spelled without spaces around its dots, as usual) first appears as a
    whole name in ``node`` after ``start_after``: ``(line, column)``, 0-based."""
    line, col = start_after
    while line <= node.end_lineno - 1:
        text = lines[line]
        found = text.find(name, col)
        while found >= 0:
            before = text[found - 1] if found > 0 else " "
            after = text[found + len(name)] if found + len(name) < len(text) else " "
            if not (before.isalnum() or before in "_.") and not (after.isalnum() or after == "_"):
                return line, found
            found = text.find(name, found + 1)
        line, col = line + 1, 0
    raise ValueError(f"line {node.lineno}: cannot find {name!r} in the import statement as written")


def port_source(source: str, filename: str = "<source>") -> Tuple[str, List[str]]:
    """``(new source, notes)``: ``source`` with its torchrec / fbgemm_gpu imports rewritten; the notes
    say what else the program may need (one line each)."""
    tree = ast.parse(source, filename=filename)
    lines = source.splitlines(keepends=True)
    edits = _Edits(lines)
    first_end: Optional[Tuple[int, int]] = None
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _mapped(node.module):
            line, col = _find_name(lines, node, node.module, (node.lineno - 1, 0))
            edits.edits.append((line, col, col + len(node.module), _mapped(node.module)))
        elif isinstance(node, ast.Import) and any(_mapped(a.name) for a in node.names):
            position = (node.lineno - 1, 0)
            for alias in node.names:
                line, col = _find_name(lines, node, alias.name, position)
                end = col + len(alias.name)
                if alias.asname is not None:  # the whole "name as asname" clause
                    clause = re.match(r"\s+as\s+" + re.escape(alias.asname) + r"\b", lines[line][end:])
                    if clause is None:
                        raise ValueError(f"line {node.lineno}: cannot rewrite this import as written")
                    end += clause.end()
                if _mapped(alias.name):
                    edits.edits.append((line, col, end, _alias_text(alias)))
                position = (line, end)
        else:
            continue
        end_line = node.end_lineno - 1
        end_col = _byte_col_to_char(lines[end_line], node.end_col_offset)
        if first_end is None or (end_line, end_col) < first_end:
            first_end = (end_line, end_col)
    notes = []
    if "torch.ops.fbgemm." in source:
        if first_end is not None:
            edits.edits.append((first_end[0], first_end[1], first_end[1], f"; {OPS_IMPORT}"))
        else:
            notes.append(f"{filename}: calls torch.ops.fbgemm but imports no torchrec: add `{OPS_IMPORT}`")
    return edits.apply(), notes


def port_file(path: str, write: bool) -> Tuple[str, List[str]]:
    """The unified diff of ``path`` ported (empty if nothing changes), and the notes; writes the file
    when ``write``."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    new, notes = port_source(source, path)
    diff = "".join(
        difflib.unified_diff(source.splitlines(keepends=True), new.splitlines(keepends=True), path, path)
    )
    if write and new != source:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return diff, notes


def run(args) -> int:
    code = 0
    for path in args.files:
        try:
            diff, notes = port_file(path, args.write)
        except (OSError, SyntaxError, ValueError, UnicodeDecodeError) as err:
            print(f"{PROG}: error: {path}: {err}", file=sys.stderr)
            code = 1
            continue
        sys.stdout.write(diff)
        for note in notes:
            print(f"{PROG}: note: {note}", file=sys.stderr)
    return code


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "port",
        help="rewrite a program's torchrec / fbgemm_gpu imports to shardkit's (prints the diff)",
        usage=USAGE,
    )
    parser.add_argument("--write", action="store_true", help="also write the rewritten files in place")
    parser.add_argument("files", nargs="+", metavar="FILE", help="python files to port")
    parser.set_defaults(run=run)
