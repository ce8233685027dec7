"""Tile shapes of the Triton embedding kernels, chosen by measurement on the GPU that runs them.

The best tile differs between GPUs and optimizers: on an H200 the pooled forward ran at 0.63 of the
copy bandwidth with the fixed tile (32 ids x 128 columns, 4 warps) and at 0.78 with 2 warps; the
fused backward's best rows-per-program went from 4 (SGD) to 16 (Adam) (``benchmarks/gpu_tiles.py``).
So the first large call of each kind times a few candidate tiles on this device (CUDA events, best
of 3) and keeps the fastest for that key:

- forward: the candidates run the call itself (the forward is pure: each run writes the same output);
- fused backward: the candidates run on a scratch table of the same width and dtype (up to 256 MiB,
  beyond any GPU's L2 cache) with as many uniform random ids as the call, so the user's table and
  optimizer state are never stepped more than once.

Calls with fewer than ``SHARDKIT_TRITON_TUNE_MIN_IDS`` ids (default 32768) take the fixed tile, as
do all calls with ``SHARDKIT_TRITON_TUNE=0`` and Triton's interpreter. The choice is per process,
keyed by everything that compiles into the kernel plus the power of two of the number of ids.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Dict, Hashable, List, Sequence, Tuple

import torch

Tile = Tuple[int, int]  # (ids or rows per program, num_warps)

TUNE = os.environ.get("SHARDKIT_TRITON_TUNE", "1") != "0"
TUNE_MIN_IDS = int(os.environ.get("SHARDKIT_TRITON_TUNE_MIN_IDS", str(1 << 15)))
SCRATCH_BYTES = 256 << 20
_chosen: Dict[Hashable, Tile] = {}


def tuning_applies(device: torch.device, num_ids: int, interpreted: bool) -> bool:
    return TUNE and not interpreted and device.type == "cuda" and num_ids >= TUNE_MIN_IDS


def _power_of_two(n: int) -> int:
    return 1 << max(0, (max(1, n) - 1).bit_length())


def forward_candidates(D: int) -> List[Tile]:
    """(BLOCK_N, num_warps): tiles of 2048, 4096 or 8192 values (BLOCK_N <= 128), 2, 4 or 8 warps."""
    block_d = _power_of_two(D)
    sizes = sorted({max(1, min(128, elements // block_d)) for elements in (2048, 4096, 8192)})
    return [(n, w) for n in sizes for w in (2, 4, 8)]


def segment_candidates(D: int) -> List[Tile]:
    """(SEGS, num_warps): 512, 1024 or 2048 values per program, at least 2 values per thread."""
    block_d = _power_of_two(D)
    out = []
    for elements in (512, 1024, 2048):
        segs = max(1, min(64, elements // block_d))
        out += [(segs, w) for w in (2, 4, 8) if segs * block_d >= 2 * 32 * w]
    return sorted(set(out)) or [(1, 1)]


def key_of(*parts: Hashable, num_ids: int) -> Tuple[Hashable, ...]:
    return (*parts, num_ids.bit_length())


def _elapsed_ms(run: Callable[[], object], device: torch.device) -> float:
    if device.type != "cuda":  # Triton's interpreter (tests)
        began = time.perf_counter()
        run()
        return (time.perf_counter() - began) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def fastest(
    key: Hashable, candidates: Sequence[Tile], run: Callable[[Tile], object], device: torch.device
) -> Tile:
    """The candidate whose ``run`` takes least time on ``device`` (best of 3 after a warm-up, which
    also compiles it), cached by ``key``."""
    if key in _chosen:
        return _chosen[key]
    best, best_ms = candidates[0], float("inf")
    for tile in candidates:
        run(tile)
        ms = min(_elapsed_ms(lambda t=tile: run(t), device) for _ in range(3))
        if ms < best_ms:
            best, best_ms = tile, ms
    _chosen[key] = best
    return best


def scratch_rows(D: int, dtype: torch.dtype, num_ids: int) -> int:
    """Rows of the backward's scratch table: as many as the ids (at least 65536), at most 256 MiB."""
    per_row = D * torch.empty(0, dtype=dtype).element_size()
    return max(1, min(max(num_ids, 1 << 16), SCRATCH_BYTES // max(1, per_row)))


def chosen() -> Dict[Hashable, Tile]:
    """The tiles chosen so far in this process (for benchmarks and tests)."""
    return dict(_chosen)


def reset() -> None:
    _chosen.clear()


__all__ = [
    "TUNE_MIN_IDS",
    "chosen",
    "fastest",
    "forward_candidates",
    "key_of",
    "reset",
    "scratch_rows",
    "segment_candidates",
    "tuning_applies",
]
