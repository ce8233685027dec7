"""Builds the native CPU kernels (``csrc/*.cpp``) on this machine, against the installed torch.

The library is compiled once per (torch version, source, compiler flags, CPU) into a cache directory
(``$SHARDKIT_CACHE``, else ``$XDG_CACHE_HOME/shardkit``, else ``~/.cache/shardkit``) and loaded with
``torch.ops.load_library``, so no binary tied to one torch version ever ships. It links against
torch's C++ libraries only (not Python), so one build serves every Python that shares the torch.

``SHARDKIT_NATIVE=0`` switches the native path off. When it is off, or the build fails (no C++
compiler, no torch headers), :func:`native_ops` returns None after printing one notice to stderr,
and callers use the pure-torch path.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, List, Optional

import torch

_SOURCES = [
    "embedding.cpp",
    "embedding_backward.cpp",
    "bucketize.cpp",
    "jagged.cpp",
    "quant_embedding.cpp",
    "row_io.cpp",
    "row_cache.cpp",
    "row_cache_queue.cpp",
    "row_cache_ids.cpp",
    "cross_entropy.cpp",
    "replica_grad.cpp",
    "columns.cpp",
]
# headers the sources include: part of the build's key (a change rebuilds); pyproject.toml's package-data
# ships them (tests/kernels/test_native_build.py checks both lists against the sources' #includes)
_HEADERS = ["embedding_common.h", "slot_map.h"]
_LOCK = threading.Lock()
_loaded: Optional[Any] = None
_tried = False
_failure: Optional[str] = None


def native_enabled_by_env() -> bool:
    """False when ``SHARDKIT_NATIVE`` is ``0`` / ``false`` / ``off``."""
    return os.environ.get("SHARDKIT_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def _compiler() -> Optional[str]:
    cxx = os.environ.get("CXX", "c++")
    return shutil.which(cxx)


def _cpu_signature() -> str:
    # -march=native code must not be reused on another CPU sharing the same home directory
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


# forces the kernels' vector width (csrc/embedding_common.h kVectorLanes), else the target's; for tests
VECTOR_LANES_ENV = "SHARDKIT_NATIVE_VECTOR_LANES"


def _flags() -> List[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -ffp-contract=off: no fused multiply-add, so `a + b * c` rounds twice as in torch's kernels;
    # 512-bit vectors where the CPU has them (gcc's default on AVX-512 machines is 256);
    # -fno-math-errno: std::sqrt need not set errno, so gcc vectorizes the Adagrad / Adam loops over a
    # row (with errno, each element was a scalar sqrtss plus a branch: Adagrad's fused backward ran 8-10x
    # slower than SGD's). IEEE sqrt is correctly rounded either way: the results do not change
    lanes = os.environ.get(VECTOR_LANES_ENV, "").strip()
    if lanes not in ("", "8", "16"):
        raise RuntimeError(f"{VECTOR_LANES_ENV} must be 8 or 16 (floats a vector sum), got {lanes!r}")
    forced = [f"-DSHARDKIT_VECTOR_LANES={lanes}"] if lanes else []
    return forced + [
        "-O3",
        "-march=native",
        "-mprefer-vector-width=512",
        "-ffp-contract=off",
        "-fno-math-errno",
        "-fopenmp",
        "-std=c++17",
        "-fPIC",
        "-shared",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
    ]


def cache_dir() -> Path:
    base = os.environ.get("SHARDKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "shardkit"
    )
    return Path(base)


def _library_path(cxx: str) -> Path:
    key = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        key.update((Path(__file__).parent / "csrc" / name).read_bytes())
    for part in (torch.__version__, torch.__file__, cxx, " ".join(_flags()), _cpu_signature()):
        key.update(part.encode())
    return (
        cache_dir()
        / f"native-{torch.__version__.replace('+', '_')}-{key.hexdigest()[:16]}"
        / "shardkit_native.so"
    )


def _last_lines(output: str) -> str:
    """A compiler's last lines of output on one line (the error, in a notice of one line)."""
    return " | ".join(output.strip().splitlines()[-5:])


def _build(cxx: str, target: Path) -> None:
    from torch.utils.cpp_extension import include_paths, library_paths

    target.parent.mkdir(parents=True, exist_ok=True)
    # one builder at a time (ranks of one job start together); the others wait and then load its result
    with open(target.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        includes = [f"-I{p}" for p in include_paths()]
        libraries = [f"-L{p}" for p in library_paths()] + [f"-Wl,-rpath,{p}" for p in library_paths()]
        print("shardkit: compiling the native CPU kernels (once per torch version) ...", file=sys.stderr)
        # one compiler per source file, in parallel (each parses the ATen headers), then one link
        csrc = Path(__file__).parent / "csrc"
        objects = [target.parent / f"{Path(name).stem}.{os.getpid()}.o" for name in _SOURCES]
        try:
            compiles = [
                subprocess.Popen(
                    [cxx, *_flags(), "-c", str(csrc / name), "-o", str(obj), *includes],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for name, obj in zip(_SOURCES, objects)
            ]
            # every compiler is waited for before a failure is raised: one still running would write its
            # object after the cleanup below
            outputs = [done.communicate()[0] for done in compiles]
            for name, done, output in zip(_SOURCES, compiles, outputs):
                if done.returncode != 0:
                    raise RuntimeError(f"{cxx} failed on {name}: {_last_lines(output)}")
            link = [
                cxx,
                *_flags(),
                *map(str, objects),
                "-o",
                str(tmp),
                *libraries,
                "-lc10",
                "-ltorch_cpu",
                "-ltorch",
            ]
            done = subprocess.run(link, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{cxx} failed to link: {_last_lines(done.stderr or done.stdout)}")
            os.replace(tmp, target)
        finally:
            # a failed build leaves nothing behind in the cache (the next process builds again)
            for path in [*objects, tmp]:
                path.unlink(missing_ok=True)


def native_ops() -> Optional[Any]:
    """``torch.ops.shardkit_native`` once built and loaded, or None (pure-torch path; notice printed once)."""
    global _loaded, _tried, _failure
    if _tried:
        return _loaded
    with _LOCK:
        if _tried:
            return _loaded
        try:
            if not native_enabled_by_env():
                raise RuntimeError("SHARDKIT_NATIVE=0")
            cxx = _compiler()
            if cxx is None:
                raise RuntimeError(f"no C++ compiler ('{os.environ.get('CXX', 'c++')}' not found; set CXX)")
            target = _library_path(cxx)
            if not target.exists():
                _build(cxx, target)
            torch.ops.load_library(str(target))
            _loaded = torch.ops.shardkit_native
        except Exception as exc:  # any failure means: use the pure-torch path
            _failure = str(exc)
            print(
                f"shardkit: native CPU kernels off ({_failure}); using the pure-torch path", file=sys.stderr
            )
        _tried = True
        return _loaded


def native_failure() -> Optional[str]:
    """Why the native kernels are not in use (None while untried or when they loaded)."""
    return _failure
