"""The native build's inputs and its failure path (kernels/native_build.py, kernels/csrc/, pyproject.toml).

A non-editable install (``pip install .``) holds only the files that pyproject.toml's package-data globs
name: a header that the sources ``#include`` but no glob ships breaks the user's build (``slot_map.h``
did, with ``*.cpp`` as the only glob). And a header missing from ``native_build._HEADERS`` is not part of
the build's key: an edited header would reuse the stale library.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit.kernels import native_build

CSRC = Path(native_build.__file__).parent / "csrc"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _package_data_globs() -> list:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        tomllib = pytest.importorskip("tomli")
    with open(PYPROJECT, "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-data"]["shardkit"]


def _local_includes(name: str) -> list:
    """The ``#include "..."`` names of one csrc file (the quoted form: files of this directory)."""
    return LOCAL_INCLUDE.findall((CSRC / name).read_text())


def _shipped(name: str, globs: list) -> bool:
    # package-data globs are relative to the package directory (src/shardkit)
    return any(fnmatch.fnmatch(f"kernels/csrc/{name}", pattern) for pattern in globs)


def test_every_local_include_exists_and_is_shipped():
    globs = _package_data_globs()
    built = native_build._SOURCES + native_build._HEADERS
    for name in built:
        assert (CSRC / name).is_file(), f"native_build lists {name}, which is not in {CSRC}"
        assert _shipped(name, globs), f"{name} is built but no package-data glob {globs} ships it"
    for name in built:
        for included in _local_includes(name):
            assert (CSRC / included).is_file(), f"{name} includes {included!r}, which is not in {CSRC}"
            assert _shipped(included, globs), f"{name} includes {included!r}, which no glob {globs} ships"


def test_the_build_lists_every_source_and_header():
    on_disk = {p.name for p in CSRC.iterdir() if p.is_file()}
    assert sorted(n for n in on_disk if n.endswith(".cpp")) == sorted(native_build._SOURCES)
    assert sorted(n for n in on_disk if n.endswith(".h")) == sorted(native_build._HEADERS)
    # every header some source reaches, directly or through another header, is in the build's key
    reached, todo = set(), list(native_build._SOURCES)
    while todo:
        for included in _local_includes(todo.pop()):
            if included not in reached:
                reached.add(included)
                todo.append(included)
    assert reached <= set(native_build._HEADERS), sorted(reached - set(native_build._HEADERS))


# a compiler that fails: FAIL_AT=compile, on row_cache.cpp alone, as the compiler does when a header it
# includes is missing (the others' objects are written); FAIL_AT=link, at the link after every compile
_FAKE_CXX = """#!/bin/sh
out=""; source=""; compile=0
while [ $# -gt 0 ]; do
  case "$1" in -c) compile=1; shift; source="$1" ;; -o) shift; out="$1" ;; esac
  shift
done
if [ "$compile" = 1 ]; then
  case "$FAIL_AT:$source" in compile:*/row_cache.cpp) ;; *) : > "$out"; exit 0 ;; esac
  echo "$source:43:10: fatal error: slot_map.h: No such file or directory"
  exit 1
fi
echo "ld: simulated link error" >&2
exit 1
"""

_CHILD = """
import torch
from shardkit.kernels import native_failure, native_ops
from shardkit.kernels.embedding import embedding_forward
out = embedding_forward(torch.arange(12.0).view(6, 2), torch.tensor([1, 5, 5]), torch.tensor([0, 2, 3]))
print("native", native_ops() is not None, "out", out.tolist())
print("failure", native_failure())
"""


@pytest.mark.parametrize("fail_at", ["compile", "link"])
def test_a_failed_build_takes_the_torch_path_with_one_clear_notice(tmp_path, fail_at):
    cxx = tmp_path / "fake-c++"
    cxx.write_text(_FAKE_CXX)
    cxx.chmod(cxx.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items() if k != "SHARDKIT_NATIVE"}
    env.update(CXX=str(cxx), SHARDKIT_CACHE=str(tmp_path / "cache"), FAIL_AT=fail_at)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    # the lookup ran on the pure-torch path: bag 0 = rows 1 + 5, bag 1 = row 5
    assert "native False out [[12.0, 14.0], [10.0, 11.0]]" in done.stdout, done.stdout
    notices = [line for line in done.stderr.splitlines() if "native CPU kernels off" in line]
    assert len(notices) == 1, done.stderr
    # the notice says what failed, in the compiler's own words, and what runs instead
    assert "using the pure-torch path" in notices[0], notices
    if fail_at == "compile":
        assert "row_cache.cpp" in notices[0] and "slot_map.h: No such file" in notices[0], notices
    else:
        assert "failed to link" in notices[0] and "simulated link error" in notices[0], notices
    # nothing half-built is left to be loaded by the next process: it tries the build again
    assert not list((tmp_path / "cache").rglob("*.so")) and not list((tmp_path / "cache").rglob("*.o"))
