"""The native lookups' software-prefetch distance (rows ahead), chosen per machine at run time.

The native pooled forward (``csrc/embedding.cpp``) and the quantized lookup (``csrc/quant_embedding.cpp``)
read random table rows in id order and prefetch the row ``distance`` ids ahead into L2. The distance
that best hides DRAM latency depends on the CPU: 16 rows was best on the Intel Xeon the kernel was
tuned on, 64 on an AMD EPYC (Zen 5) - see docs/performance.md. The unit is rows (the kernels' loop
unit): on the EPYC, 64 rows was within 7 % of the best distance at 64 B, 256 B and 512 B rows, so one
number measured at 256 B rows serves every width; bytes ahead transfer as well only when chosen at the
wide end (4 KiB, enough at 64 B rows, was 1.4x slower than the best at 256 B rows).

:func:`prefetch_rows` returns the distance the kernels get, decided once per process:

1. ``SHARDKIT_PREFETCH_ROWS=<n>`` (an integer in ``[0, MAX_ROWS]``; 0 switches prefetching off)
   overrides everything; any other value raises ValueError at first use;
2. else the distance measured earlier on this machine, read from
   ``<native cache dir>/prefetch-<key>.json`` (key: CPU model name, family and model numbers, torch
   version, :data:`VERSION`);
3. else a short measurement (:func:`measure`, about 0.1-0.3 s once per machine and torch version):
   pooled lookups of 64-float rows from a table of a few times the L3's size, each candidate of
   :data:`CANDIDATES` timed in alternating rounds on fresh ids, one thread; the smallest candidate
   within 3% of the fastest wins, and is written to the file (one process measures, concurrent ones
   wait for its file: the ranks of a job start together).

Every distance gives the same values (a prefetch is a hint; the sums and their order do not change):
``tests/kernels/test_prefetch.py`` checks it bitwise against the pure-torch path.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Dict, Optional

import torch

from shardkit.kernels.cpu_cache import last_level_cache_bytes
from shardkit.kernels.native_build import cache_dir, native_ops

ENV = "SHARDKIT_PREFETCH_ROWS"
MAX_ROWS = 4096
CANDIDATES = (8, 16, 32, 64, 128)
# bump when the kernels' loops or the measurement change: old files are then ignored
VERSION = 2
# the schema default of the ops (csrc kPrefetch): used when no measurement can run
DEFAULT_ROWS = 16
_LOCK = threading.Lock()
_chosen: Optional[int] = None


def _parse_env(value: str) -> int:
    text = value.strip()
    try:
        rows = int(text)
    except ValueError:
        rows = -1
    if not text.lstrip("+").isdigit() or not 0 <= rows <= MAX_ROWS:
        raise ValueError(
            f"{ENV}={value!r}: expected an integer number of rows in [0, {MAX_ROWS}] (0: no prefetch)"
        )
    return rows


def cpu_model() -> str:
    """The CPU's model name with its family and model numbers (``/proc/cpuinfo``: a VM may name every
    generation ``AMD EPYC``), else the platform's processor string."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip():  # the first processor's block is enough
                    break
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    return f"{fields['model name']} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')})"


def cache_file() -> Path:
    """Where this machine's measured distance is kept (keyed by CPU model, torch version, VERSION)."""
    key = hashlib.sha256(f"{cpu_model()}|{torch.__version__}|{VERSION}".encode()).hexdigest()[:16]
    return cache_dir() / f"prefetch-{key}.json"


def measure(
    candidates=CANDIDATES, rounds: int = 5, dim: int = 64, ids_per_call: int = 32768
) -> Dict[int, float]:
    """Seconds of one pooled native lookup at each candidate distance (the fastest of ``rounds``).

    Table: fp32 ``[R, dim]`` of 4x the last-level cache (64 MiB - 256 MiB), written once so that its
    pages are real; each call reads ``ids_per_call`` fresh uniform rows in 64 bags (the op's parallel
    grain is 64 bags, so one thread runs it without touching torch's thread setting).
    """
    ops = native_ops()
    if ops is None:
        raise RuntimeError("the native kernels are not available: nothing to measure")
    table_bytes = min(max(4 * last_level_cache_bytes(), 64 << 20), 256 << 20)
    rows = table_bytes // (4 * dim)
    weight = torch.zeros(rows, dim)
    gen = torch.Generator().manual_seed(0)
    calls = rounds * len(candidates)
    all_ids = torch.randint(0, rows, (calls * ids_per_call,), generator=gen)
    bags = 64
    offsets = torch.arange(bags + 1, dtype=torch.int64) * (ids_per_call // bags)
    offsets[-1] = ids_per_call
    best = {d: float("inf") for d in candidates}
    ops.embedding_forward(weight, all_ids[:ids_per_call], offsets, None, None, None, True, 0, DEFAULT_ROWS)
    call = 0
    for _ in range(rounds):
        for d in candidates:  # alternating: a burst of load elsewhere hits every candidate alike
            ids = all_ids[call * ids_per_call : (call + 1) * ids_per_call]
            call += 1
            t0 = time.perf_counter()
            ops.embedding_forward(weight, ids, offsets, None, None, None, True, 0, d)
            best[d] = min(best[d], time.perf_counter() - t0)
    return best


def choose(seconds: Dict[int, float], tolerance: float = 0.03) -> int:
    """The smallest distance within ``tolerance`` of the fastest (a longer one only adds risk of
    evicting rows before they are read)."""
    fastest = min(seconds.values())
    return min(d for d, s in seconds.items() if s <= fastest * (1.0 + tolerance))


def _read_cached(path: Path) -> Optional[int]:
    try:
        data = json.loads(path.read_text())
        rows = int(data["rows"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or unreadable: measure again
    return rows if 0 <= rows <= MAX_ROWS else None


def _measure_and_cache(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = _read_cached(path)  # another process measured while this one waited
        if rows is not None:
            return rows
        seconds = measure()
        rows = choose(seconds)
        record = {
            "rows": rows,
            "cpu": cpu_model(),
            "torch": torch.__version__,
            "version": VERSION,
            "ms": {str(d): round(s * 1e3, 4) for d, s in seconds.items()},
        }
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
        print(
            f"shardkit: native lookups prefetch {rows} rows ahead on this CPU (measured once; {path})",
            file=sys.stderr,
        )
        return rows


def prefetch_rows() -> int:
    """The prefetch distance (rows ahead) the native lookups use in this process (see the module doc).

    Raises ValueError when ``SHARDKIT_PREFETCH_ROWS`` is set to anything but an integer in
    ``[0, MAX_ROWS]``.
    """
    global _chosen
    if _chosen is not None:
        return _chosen
    with _LOCK:
        if _chosen is None:
            env = os.environ.get(ENV)
            if env is not None:
                _chosen = _parse_env(env)
            elif native_ops() is None:
                _chosen = DEFAULT_ROWS  # nothing native runs: nothing to measure
            elif torch.compiler.is_compiling():
                # no measurement inside a trace (its tensors may be fake); decided at the first eager call
                cached = _read_cached(cache_file())
                return DEFAULT_ROWS if cached is None else cached
            else:
                path = cache_file()
                cached = _read_cached(path)
                if cached is None:
                    try:
                        cached = _measure_and_cache(path)
                    except OSError as exc:  # no writable cache dir: measure for this process only
                        print(f"shardkit: prefetch distance not cached ({exc})", file=sys.stderr)
                        cached = choose(measure())
                _chosen = cached
        return _chosen


def forget_choice() -> None:
    """Decide again at the next :func:`prefetch_rows` (the environment and the file are read anew)."""
    global _chosen
    with _LOCK:
        _chosen = None


__all__ = ["CANDIDATES", "ENV", "MAX_ROWS", "cache_file", "forget_choice", "measure", "prefetch_rows"]
