"""Embedding lookup on one CUDA device: the Triton kernels vs the pure-torch path vs nn.EmbeddingBag,
each as achieved bandwidth over the device's copy bandwidth measured in the same run.

Run from the repository root: ``python -m benchmarks.gpu [--rows 1000000 --dim 128 --batch 65536
--pooling 32]``. Without a CUDA device it says so and exits 0 (writing an empty result only to an
explicit ``--out``, so that a CPU run never replaces the GPU figures in benchmarks/results/).

Workload: one fp32 ``[rows, dim]`` table, ``batch`` bags of 1/2..3/2 x ``pooling`` uniform random ids
(int64), SUM pooling.

- forward: ``[batch, dim]`` bag sums. Bytes = the rows read (ids x dim x 4) + ids + offsets + output.
  Triton with and without the id check (the check costs one host sync per call), the pure-torch path
  (``embedding_torch``, i.e. ``F.embedding_bag``) and ``nn.EmbeddingBag``.
- fused backward + update: every touched row gets one optimizer step from the fp32 sum of its ids'
  gradients. Bytes = one grad row per id + ids + each distinct row (U of them) read and written + the
  optimizer state of those rows read and written. Triton and pure torch for SGD, Adagrad, row-wise
  Adagrad and Adam; ``nn.EmbeddingBag(sparse=True)`` backward + ``torch.optim.SGD.step`` (its forward
  runs outside the timed region).
- cross-entropy over one ``[T, V/tp]`` bf16 shard (``--ce-tokens`` x ``--ce-vocab``, default 16384 x
  64000): the Triton kernels of :mod:`shardkit.kernels.triton_ce` (statistics pass, then the gradient
  written over the logits) vs ``F.cross_entropy`` + backward, and ``vocab_parallel_cross_entropy``
  (mean loss, forward + backward) with its Triton passes and with its torch blocks; bytes = the shard
  read twice and written once; ``peak_extra_mib`` = ``torch.cuda.max_memory_allocated`` above the
  memory in use at the start (the logits included in neither), also in units of one shard.
- ``copy``: ``dst.copy_(src)`` of ``--copy-mib`` MiB; bytes = read + write. ``ratio_to_copy`` of a
  row = its GB/s over the copy's.

Times are medians of CUDA-event intervals. Every Triton result is checked against the torch path
before it is timed.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from benchmarks.common import machine, write_results
from shardkit.kernels import OPTIMIZERS, RowOptimizerArgs, embedding_torch

GOALS = {"forward": 0.6, "fused backward+update": 0.3, "cross-entropy": 0.7}


DEVICE = "cuda"  # "cpu" only for --smoke-on-cpu


def cuda_ms(
    fn: Callable[[Any], Any], setup: Optional[Callable[[], Any]], repeats: int, warmup: int = 2
) -> float:
    """Median milliseconds of ``fn(setup())`` on the GPU's clock; ``setup`` runs outside the interval."""
    times = []
    for i in range(warmup + repeats):
        arg = setup() if setup is not None else None
        if DEVICE == "cpu":
            began = time.perf_counter()
            fn(arg)
            elapsed = (time.perf_counter() - began) * 1e3
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn(arg)
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        if i >= warmup:
            times.append(elapsed)
    times.sort()
    return times[len(times) // 2]


def _state(kind: str, rows: int, dim: int) -> tuple:
    shapes = {"SGD": [], "ADAGRAD": [(rows, dim)], "ROWWISE_ADAGRAD": [(rows,)], "ADAM": [(rows, dim)] * 2}
    return tuple(torch.zeros(shape, device=DEVICE) for shape in shapes[kind])


def _state_bytes_per_row(kind: str, dim: int) -> int:
    """fp32 state bytes read + written per touched row."""
    return 2 * 4 * {"SGD": 0, "ADAGRAD": dim, "ROWWISE_ADAGRAD": 1, "ADAM": 2 * dim}[kind]


def _copy_ms(nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes // 4, device=DEVICE)
    dst = torch.empty_like(src)
    return cuda_ms(lambda _: dst.copy_(src), None, repeats)


def _fused_step(module, table, batch_args, optimizer, _) -> None:
    module.embedding_fused_backward(table, *batch_args, optimizer, False)


def run(args: argparse.Namespace) -> List[Dict[str, Any]]:
    from shardkit.kernels import select_backend, triton_embedding

    if not triton_embedding.available(torch.empty(1, 1, device=DEVICE)):
        raise SystemExit(f"triton kernels unavailable on {DEVICE}: {triton_embedding.triton_failure()}")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows, dim, batch = args.rows, args.dim, args.batch
    weight = torch.randn(rows, dim, device=DEVICE, generator=gen)
    shortest, longest = args.pooling // 2, args.pooling * 3 // 2
    lengths = torch.randint(shortest, longest + 1, (batch,), device=DEVICE, generator=gen)
    offsets = torch.zeros(batch + 1, dtype=torch.int64, device=DEVICE)
    offsets[1:] = lengths.cumsum(0)
    n = int(offsets[-1])
    ids = torch.randint(0, rows, (n,), device=DEVICE, generator=gen)
    distinct = int(torch.unique(ids).numel())
    grad = torch.randn(batch, dim, device=DEVICE, generator=gen)
    if DEVICE == "cuda":  # the automatic choice (CPU tables never go to Triton)
        assert select_backend(weight, ids) == "triton"

    copy_bytes = args.copy_mib << 20
    copy_ms = _copy_ms(copy_bytes, args.repeats)
    copy_gbs = 2 * copy_bytes / copy_ms / 1e6
    out_rows: List[Dict[str, Any]] = [
        {
            "name": f"device copy ({args.copy_mib} MiB)",
            "op": "copy",
            "ms": copy_ms,
            "GB/s": copy_gbs,
            "ratio_to_copy": 1.0,
        }
    ]

    def row(name: str, op: str, ms: float, nbytes: int, **extra: Any) -> Dict[str, Any]:
        gbs = nbytes / ms / 1e6
        out = {"name": name, "op": op, "ms": ms, "GB/s": gbs, "ratio_to_copy": gbs / copy_gbs}
        out.update(extra)
        if op in GOALS:
            out["goal"] = GOALS[op]
        print(f"  {name}: {ms:.3f} ms, {gbs:.1f} GB/s, {gbs / copy_gbs:.3f} of copy", flush=True)
        return out

    # forward
    fwd_bytes = n * dim * 4 + n * 8 + (batch + 1) * 8 + batch * dim * 4
    want = embedding_torch.embedding_forward(weight, ids, offsets, None, None, None, True)
    got = triton_embedding.embedding_forward(weight, ids, offsets, None, None, None, True)
    fwd_err = float((got - want).abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    del got, want
    triton_fwd = lambda _: triton_embedding.embedding_forward(weight, ids, offsets, None, None, None, True)  # noqa: E731
    out_rows.append(
        row(
            "triton forward",
            "forward",
            cuda_ms(triton_fwd, None, args.repeats),
            fwd_bytes,
            max_abs_err_vs_torch=fwd_err,
        )
    )
    checked = triton_embedding.CHECK_IDS
    triton_embedding.CHECK_IDS = False
    try:
        ms = cuda_ms(triton_fwd, None, args.repeats)
    finally:
        triton_embedding.CHECK_IDS = checked
    out_rows.append(row("triton forward, unchecked ids", "forward", ms, fwd_bytes))
    torch_fwd = lambda _: embedding_torch.embedding_forward(weight, ids, offsets, None, None, None, True)  # noqa: E731
    out_rows.append(row("torch-path forward", "forward", cuda_ms(torch_fwd, None, args.repeats), fwd_bytes))
    bag = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, include_last_offset=True).to(DEVICE)
    with torch.no_grad():
        bag.weight.copy_(weight)
    with torch.no_grad():
        ms = cuda_ms(lambda _: bag(ids, offsets), None, args.repeats)
    out_rows.append(row("nn.EmbeddingBag forward", "forward", ms, fwd_bytes))

    # fused backward + update
    batch_args = (ids, offsets, None, None, None, grad, True)
    for kind in OPTIMIZERS:
        bwd_bytes = n * dim * 4 + n * 8 + distinct * (2 * dim * 4 + _state_bytes_per_row(kind, dim))
        # correctness of one step against the torch path, from the same start
        table, ref = weight.clone(), weight.clone()
        # eps well above the rounding noise of near-zero gradient sums: with Adam's eps=1e-8 a row whose
        # ids' gradients cancel turns a reassociation difference into a visible one
        opt = dict(lr=0.01, eps=1e-3, step=1)
        args_mine = RowOptimizerArgs(kind, state=_state(kind, rows, dim), **opt)
        args_ref = RowOptimizerArgs(kind, state=_state(kind, rows, dim), **opt)
        triton_embedding.embedding_fused_backward(table, *batch_args, args_mine, False)
        embedding_torch.embedding_fused_backward(ref, *batch_args, args_ref, False)
        err = float((table - ref).abs().max())
        torch.testing.assert_close(table, ref, rtol=1e-5, atol=1e-5)
        ref = args_ref = None
        for path, module in (("triton", triton_embedding), ("torch-path", embedding_torch)):
            step = functools.partial(_fused_step, module, table, batch_args, args_mine)
            extra = {"max_abs_err_vs_torch": err} if path == "triton" else {}
            ms = cuda_ms(step, None, args.repeats)
            out_rows.append(
                row(
                    f"{path} fused backward + {kind}",
                    "fused backward+update",
                    ms,
                    bwd_bytes,
                    distinct_rows=distinct,
                    **extra,
                )
            )
        table = args_mine = None
        torch.cuda.empty_cache()

    sgd = torch.optim.SGD(bag.parameters(), lr=0.01)

    def forward_for_backward():
        return bag(ids, offsets)

    def backward_step(out):
        out.backward(grad)
        sgd.step()
        sgd.zero_grad(set_to_none=True)

    bwd_bytes = n * dim * 4 + n * 8 + distinct * 2 * dim * 4
    out_rows.append(
        row(
            "nn.EmbeddingBag(sparse) backward + SGD.step",
            "fused backward+update",
            cuda_ms(backward_step, forward_for_backward, args.repeats),
            bwd_bytes,
            distinct_rows=distinct,
        )
    )
    # the part of the fused backward that is torch.sort (of int32 keys, as the Triton path sorts them)
    keys = ids.to(torch.int32)
    out_rows.append(
        {
            "name": "(of which: torch.sort of the ids)",
            "op": "part",
            "ms": cuda_ms(lambda _: torch.sort(keys, stable=True), None, args.repeats),
        }
    )
    try:
        out_rows += _skewed_rows(args, weight, offsets, grad, row)
    except Exception as error:  # a failure here must not lose the rows above
        out_rows.append({"name": "skewed ids", "op": "error", "error": repr(error)})
    weight = grad = None
    torch.cuda.empty_cache()
    try:
        out_rows += _ce_rows(args, row)
    except Exception as error:
        out_rows.append({"name": "cross-entropy", "op": "error", "error": repr(error)})
    args.ids = n
    args.distinct_rows = distinct
    from shardkit.kernels import triton_tiles

    # the tiles measured on this device at the first large call of each kind (shardkit.kernels.triton_tiles)
    args.measured_tiles = {str(key): tile for key, tile in triton_tiles.chosen().items()}
    return out_rows


def _skewed_rows(args, weight, offsets, grad, row) -> List[Dict[str, Any]]:
    """The same batch with skewed ids (a cubed uniform draw: row 0 alone is read ~1% of the time), so
    that many rows go to the long-row path of the Triton backward. SGD only."""
    from shardkit.kernels import triton_embedding

    gen = torch.Generator(device=DEVICE).manual_seed(1)
    n = int(offsets[-1])
    ids = (torch.rand(n, device=DEVICE, generator=gen).pow(3) * args.rows).to(torch.int64)
    distinct = int(torch.unique(ids).numel())
    batch_args = (ids, offsets, None, None, None, grad, True)
    table, ref = weight.clone(), weight.clone()
    opt = RowOptimizerArgs("SGD", lr=0.01)
    triton_embedding.embedding_fused_backward(table, *batch_args, opt, False)
    embedding_torch.embedding_fused_backward(ref, *batch_args, opt, False)
    err = float((table - ref).abs().max())
    torch.testing.assert_close(table, ref, rtol=1e-5, atol=1e-5)
    ref = None
    nbytes = n * args.dim * 4 + n * 8 + distinct * 2 * args.dim * 4
    out = []
    for path, module in (("triton", triton_embedding), ("torch-path", embedding_torch)):
        ms = cuda_ms(functools.partial(_fused_step, module, table, batch_args, opt), None, args.repeats)
        extra = {"max_abs_err_vs_torch": err} if path == "triton" else {}
        out.append(
            row(
                f"{path} fused backward + SGD, skewed ids",
                "fused backward+update",
                ms,
                nbytes,
                distinct_rows=distinct,
                **extra,
            )
        )
    return out


def _peak_extra_mib(fn: Callable[[Any], Any], arg: Any) -> float:
    """Memory ``fn(arg)`` allocates on top of what is in use when it starts (CUDA only)."""
    if DEVICE != "cuda":
        fn(arg)
        return float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(arg)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def _ce_rows(args, row) -> List[Dict[str, Any]]:
    """Cross-entropy forward + backward over one ``[T, V/tp]`` bf16 shard (tp = 1: the shard's statistics
    are the global ones): the Triton kernels (statistics pass, gradient pass written over the logits)
    vs ``F.cross_entropy`` + backward. Bytes: the shard read twice and written once."""
    import torch.nn.functional as F

    from shardkit.kernels import kernel_backend, triton_ce
    from shardkit.losses import vocab_parallel_cross_entropy

    tokens, vocab = args.ce_tokens, args.ce_vocab
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    logits = torch.randn(tokens, vocab, device=DEVICE, generator=gen).to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), device=DEVICE, generator=gen)
    scale = torch.full((tokens,), 1.0 / tokens, device=DEVICE)
    shard_mib = logits.numel() * logits.element_size() / 2**20

    def triton_step(work):
        top, total, target_logit = triton_ce.ce_statistics(work, target, 0)
        loss = (torch.log(total) + top - target_logit).mean()
        triton_ce.ce_gradient(work, target, 0, top, total, scale, out=work)
        return loss

    def torch_step(leaf):
        loss = F.cross_entropy(leaf, target)
        loss.backward()
        return loss

    work = logits.clone()
    loss = triton_step(work)
    leaf = logits.clone().requires_grad_()
    torch_step(leaf)
    want = F.cross_entropy(logits.float(), target)  # F.cross_entropy of bf16 returns a bf16 loss
    loss_err = abs(float(loss) - float(want))
    grad_err = float((work.float() - leaf.grad.float()).abs().max())
    assert loss_err <= 1e-3 * max(1.0, abs(float(want))), (float(loss), float(want))
    assert grad_err <= 1e-3, grad_err
    work = leaf = None
    nbytes = 3 * logits.numel() * logits.element_size()
    out = []

    def shardkit_step(backend):
        def step(leaf):
            with kernel_backend(backend):
                loss = vocab_parallel_cross_entropy(leaf, target, reduction="mean")
                loss.backward()
            return loss

        return step

    def new_leaf():
        return logits.clone().requires_grad_()

    cases = (
        ("triton CE statistics + gradient (over the logits)", triton_step, logits.clone),
        ("F.cross_entropy forward + backward", torch_step, new_leaf),
        # the library call, fwd + bwd of the mean loss, with each backend of its two passes
        ("shardkit vocab_parallel_cross_entropy, triton passes", shardkit_step("triton"), new_leaf),
        ("shardkit vocab_parallel_cross_entropy, torch blocks", shardkit_step("torch"), new_leaf),
    )
    for name, step, setup in cases:
        ms = cuda_ms(step, setup, args.repeats)
        peak = _peak_extra_mib(step, setup())
        out.append(
            row(
                name,
                "cross-entropy",
                ms,
                nbytes,
                peak_extra_mib=peak,
                peak_extra_shards=peak / shard_mib,
                tokens=tokens,
                vocab_shard=vocab,
            )
        )
    out[0]["loss_abs_err_vs_torch"] = loss_err
    out[0]["grad_max_abs_err_vs_torch"] = grad_err
    return out


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=65536, help="bags")
    parser.add_argument("--pooling", type=int, default=32, help="mean ids per bag")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--ce-tokens", type=int, default=16384, help="cross-entropy rows: tokens T")
    parser.add_argument("--ce-vocab", type=int, default=64000, help="cross-entropy rows: vocabulary shard")
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    parser.add_argument(
        "--smoke-on-cpu",
        action="store_true",
        help="check this script on a CPU machine (needs TRITON_INTERPRET=1 and tiny sizes); the figures mean "
        "nothing and go only to --out",
    )
    args = parser.parse_args(argv)
    if args.smoke_on_cpu:
        global DEVICE
        DEVICE = "cpu"
        rows = run(args)
        if args.out:
            write_results("gpu", {k: v for k, v in vars(args).items() if k != "out"}, rows, args.out)
        return
    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py: no CUDA device here; nothing measured (run it on a GPU machine, e.g. "
            "tools/device_check.sh)"
        )
        if args.out:
            path = Path(args.out) / "gpu.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            config = {
                **{k: v for k, v in vars(args).items() if k != "out"},
                "skipped": "no CUDA device",
                "machine": machine(),
            }
            path.write_text(json.dumps({"benchmark": "gpu", "config": config, "rows": []}, indent=2))
        return
    print(f"device: {torch.cuda.get_device_name(0)}", flush=True)
    rows = run(args)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config.update(
        dtype="fp32", ids_dtype="int64", pooling_mode="sum", goals=GOALS, device=torch.cuda.get_device_name(0)
    )
    write_results("gpu", config, rows, args.out)


if __name__ == "__main__":
    main()
