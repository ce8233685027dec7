"""Where the Triton embedding kernels' time goes on this GPU: a sweep of their tile shapes, and a
profile of one forward and one fused backward per optimizer.

Run from the repository root: ``python -m benchmarks.gpu_tiles --out DIR``. The workload is
``benchmarks/gpu.py``'s (one fp32 ``[rows, dim]`` table, ``batch`` bags of 1/2..3/2 x ``pooling``
uniform ids). Without a CUDA device it says so and exits 0.

- ``forward`` rows: ``embedding_forward`` with every ``(BLOCK_N, num_warps)`` of the sweep (ids per
  tile, warps per program), as bandwidth over the copy bandwidth (the bytes of ``benchmarks/gpu.py``).
- ``backward`` rows: ``embedding_fused_backward`` with every ``(SEGS, num_warps)`` (distinct rows per
  program) for each optimizer; the whole call (sort, segment heads, kernels).
- ``profile`` rows: CUDA time per kernel name of one call at the current tiles (``torch.profiler``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from benchmarks import gpu
from benchmarks.common import write_results
from shardkit.kernels import OPTIMIZERS, RowOptimizerArgs

FORWARD_TILES = [(n, w) for n in (8, 16, 32, 64, 128) for w in (2, 4, 8)]
SEGMENT_TILES = [(s, w) for s in (4, 8, 16, 32) for w in (1, 2, 4, 8)]


def _profile(fn, label: str) -> List[Dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    on_gpu = gpu.DEVICE == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    rows = []
    for event in prof.key_averages():
        us = (getattr(event, "device_time_total", 0) if on_gpu else event.cpu_time_total) or 0
        if us > 0:
            rows.append({"name": f"{label}: {event.key[:60]}", "op": "profile", "ms": us / 1e3})
    rows.sort(key=lambda r: -r["ms"])
    return rows[:12]


def run(args: argparse.Namespace) -> List[Dict[str, Any]]:
    from shardkit.kernels import triton_embedding as te
    from shardkit.kernels import triton_tiles

    triton_tiles.TUNE = False  # the sweep sets the tiles itself

    gen = torch.Generator(device=gpu.DEVICE).manual_seed(0)
    rows, dim, batch = args.rows, args.dim, args.batch
    weight = torch.randn(rows, dim, device=gpu.DEVICE, generator=gen)
    lengths = torch.randint(
        args.pooling // 2, args.pooling * 3 // 2 + 1, (batch,), device=gpu.DEVICE, generator=gen
    )
    offsets = torch.zeros(batch + 1, dtype=torch.int64, device=gpu.DEVICE)
    offsets[1:] = lengths.cumsum(0)
    n = int(offsets[-1])
    ids = torch.randint(0, rows, (n,), device=gpu.DEVICE, generator=gen)
    distinct = int(torch.unique(ids).numel())
    grad = torch.randn(batch, dim, device=gpu.DEVICE, generator=gen)
    copy_bytes = args.copy_mib << 20
    copy_gbs = 2 * copy_bytes / gpu._copy_ms(copy_bytes, args.repeats) / 1e6
    out: List[Dict[str, Any]] = [{"name": "device copy", "op": "copy", "GB/s": copy_gbs}]

    def ratio(nbytes: int, ms: float) -> float:
        return nbytes / ms / 1e6 / copy_gbs

    original_tile, original_segment_tile = te._tile, te._segment_tile
    fwd_bytes = n * dim * 4 + n * 8 + (batch + 1) * 8 + batch * dim * 4
    forward = lambda _: te.embedding_forward(weight, ids, offsets, None, None, None, True)  # noqa: E731
    want = forward(None)
    try:
        for block_n, warps in FORWARD_TILES:
            te._tile = lambda D, *a, _n=block_n, _w=warps, **k: (_n, te.triton.next_power_of_2(D), _w)
            torch.testing.assert_close(forward(None), want)
            ms = gpu.cuda_ms(forward, None, args.repeats)
            out.append({"name": f"forward BLOCK_N={block_n} warps={warps}", "op": "forward", "ms": ms,
                        "ratio_to_copy": ratio(fwd_bytes, ms)})  # fmt: skip
    finally:
        te._tile = original_tile
    out += _profile(lambda: forward(None), "forward")
    for kind in OPTIMIZERS:
        nbytes = n * dim * 4 + n * 8 + distinct * (2 * dim * 4 + gpu._state_bytes_per_row(kind, dim))
        table = weight.clone()
        opt = RowOptimizerArgs(kind, lr=0.01, eps=1e-3, step=1, state=gpu._state(kind, rows, dim))
        step = lambda _, t=table, o=opt: te.embedding_fused_backward(  # noqa: E731
            t, ids, offsets, None, None, None, grad, True, o, False
        )
        try:
            for segs, warps in SEGMENT_TILES:
                te._segment_tile = lambda D, _s=segs, _w=warps: (_s, te.triton.next_power_of_2(D), _w)
                ms = gpu.cuda_ms(step, None, args.repeats)
                out.append({"name": f"backward {kind} SEGS={segs} warps={warps}", "op": "backward",
                            "ms": ms, "ratio_to_copy": ratio(nbytes, ms)})  # fmt: skip
        finally:
            te._segment_tile = original_segment_tile
        out += _profile(lambda s=step: s(None), f"backward {kind}")
        table = opt = None
        print(f"done: backward {kind}", flush=True)
    return out


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--pooling", type=int, default=32)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke-on-cpu", action="store_true", help="tiny sizes under TRITON_INTERPRET=1")
    args = p.parse_args(argv)
    if args.smoke_on_cpu:
        gpu.DEVICE = "cpu"
        global FORWARD_TILES, SEGMENT_TILES
        FORWARD_TILES, SEGMENT_TILES = FORWARD_TILES[:2], SEGMENT_TILES[:2]
    elif not torch.cuda.is_available():
        print("benchmarks.gpu_tiles: no CUDA device here; nothing measured")
        return
    rows = run(args)
    device = "cpu (smoke)" if args.smoke_on_cpu else torch.cuda.get_device_name(0)
    config = {**vars(args), "out": str(args.out), "device": device}
    write_results("gpu_tiles", config, rows, args.out)


if __name__ == "__main__":
    main()
