"""Language-model losses on one CUDA device: shardkit vs ``F.cross_entropy`` vs liger-kernel, time and
peak memory in the same run.

Run from the repository root: ``python -m benchmarks.gpu_losses --out DIR [--quick]``. liger-kernel is
optional (``pip install liger-kernel``; its rows are left out, saying so, when it does not import).
Without a CUDA device it says so and exits 0, unless ``--smoke-on-cpu`` runs tiny shapes on the CPU
(how the script itself is tested; liger needs CUDA and is left out there).

Two kinds of rows, each at every ``(T, V, dtype)`` of the sweep, one process, no process group (tp = 1:
the loss over the whole vocabulary, as a tensor-parallel rank's shard would be):

- ``ce``: forward + backward of the mean cross-entropy over ``[T, V]`` logits, ~5% ignored targets.
  ``torch``: ``F.cross_entropy``; ``shardkit``: ``vocab_parallel_cross_entropy`` (its default path:
  the Triton kernels on CUDA); ``liger``: ``LigerCrossEntropyLoss``.
- ``linear_ce``: forward + backward of the mean cross-entropy of ``hidden [T, H] @ weight[V, H]^T``,
  gradients for both. ``torch``: the matmul, then ``F.cross_entropy``; ``shardkit``:
  ``vocab_parallel_linear_cross_entropy``; ``liger``: ``LigerFusedLinearCrossEntropyLoss``.

``ms``: median of CUDA-event intervals (``--repeats``, after one warm-up that is also the correctness
check). ``peak_extra_mib``: ``torch.cuda.max_memory_allocated`` during one step above the memory in
use before it (the inputs included in neither). ``loss_diff``: |loss - torch's loss| on the same
inputs. ``time_vs_torch`` / ``peak_vs_torch``: ratios to the ``torch`` row of the same shape (< 1 is
better); ``time_vs_liger``: to the liger row.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from benchmarks.common import write_results
from shardkit.losses import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IGNORED_EVERY = 20


def _liger() -> Optional[Any]:
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss
    except Exception as err:  # noqa: BLE001 - any import failure means "no liger rows"
        print(f"liger-kernel not importable ({type(err).__name__}: {err}); its rows are left out")
        return None
    return LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed_ms(step: Callable[[], Any], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            step()
            times.append((time.perf_counter() - began) * 1e3)
    return sorted(times)[len(times) // 2]


def _measure(step: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> Dict[str, float]:
    """One warm-up step (its loss and peak memory), then the median time of ``repeats`` steps."""
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    loss = float(step())
    _sync(device)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else float("nan")
    return {"loss": loss, "peak_extra_mib": peak, "ms": _timed_ms(step, device, repeats)}


def _ce_steps(T: int, V: int, dtype: torch.dtype, device: torch.device, liger) -> Dict[str, Callable]:
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.empty(T, V, dtype=dtype, device=device).normal_(generator=gen).requires_grad_()
    target = torch.randint(0, V, (T,), device=device, generator=gen)
    target[::IGNORED_EVERY] = -100

    def run(loss_fn):
        def step():
            loss = loss_fn(logits, target)
            loss.backward()
            # freed here, not at the next step's start: the next variant's peak must not be measured
            # against a base that still holds this one's gradient
            logits.grad = None
            return loss.detach()

        return step

    steps = {
        "torch": run(lambda x, t: F.cross_entropy(x, t)),
        "shardkit": run(lambda x, t: vocab_parallel_cross_entropy(x, t, reduction="mean")),
    }
    if liger is not None:
        steps["liger"] = run(liger[0]())
    return steps


def _linear_ce_steps(T, V, H, dtype, device, liger) -> Dict[str, Callable]:
    gen = torch.Generator(device=device).manual_seed(1)
    hidden = torch.empty(T, H, dtype=dtype, device=device).normal_(generator=gen).requires_grad_()
    weight = torch.empty(V, H, dtype=dtype, device=device).normal_(std=H**-0.5, generator=gen)
    weight.requires_grad_()
    target = torch.randint(0, V, (T,), device=device, generator=gen)
    target[::IGNORED_EVERY] = -100

    def run(loss_fn):
        def step():
            loss = loss_fn(hidden, weight, target)
            loss.backward()
            hidden.grad = weight.grad = None  # as in _ce_steps
            return loss.detach()

        return step

    steps = {
        "torch": run(lambda h, w, t: F.cross_entropy(h @ w.t(), t)),
        "shardkit": run(lambda h, w, t: vocab_parallel_linear_cross_entropy(h, w, t, reduction="mean")),
    }
    if liger is not None:
        fused = liger[1]()
        steps["liger"] = run(lambda h, w, t: fused(w, h, t))
    return steps


def _rows_of(kind: str, shape: Dict[str, Any], steps: Dict[str, Callable], device, repeats) -> List[Dict]:
    measured = {}
    for name, step in steps.items():
        try:
            measured[name] = _measure(step, device, repeats)
        except torch.cuda.OutOfMemoryError as err:
            print(f"{kind} {shape} {name}: out of memory ({err})")
            torch.cuda.empty_cache()
    rows = []
    base, liger = measured.get("torch"), measured.get("liger")
    for name, m in measured.items():
        row = {"name": f"{kind} {name}", "kind": kind, "impl": name, **shape, **m}
        if base is not None:
            row["loss_diff"] = abs(m["loss"] - base["loss"])
            row["time_vs_torch"] = m["ms"] / base["ms"]
            row["peak_vs_torch"] = (
                m["peak_extra_mib"] / base["peak_extra_mib"] if base["peak_extra_mib"] else None
            )
        if liger is not None:
            row["time_vs_liger"] = m["ms"] / liger["ms"]
        rows.append(row)
    print(f"done: {kind} {shape}", flush=True)
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


def run(args: argparse.Namespace) -> List[Dict[str, Any]]:
    device = torch.device("cpu" if args.smoke_on_cpu else "cuda")
    liger = _liger() if device.type == "cuda" else None
    rows: List[Dict[str, Any]] = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for T in args.tokens:
            for V in args.vocab:
                shape = {"T": T, "V": V, "dtype": dtype_name}
                rows += _rows_of("ce", shape, _ce_steps(T, V, dtype, device, liger), device, args.repeats)
                if T <= args.linear_max_tokens[dtype_name]:
                    shape = {**shape, "H": args.hidden}
                    steps = _linear_ce_steps(T, V, args.hidden, dtype, device, liger)
                    rows += _rows_of("linear_ce", shape, steps, device, args.repeats)
    return rows


def _profile_linear(args: argparse.Namespace) -> None:
    """CUDA time per kernel of one shardkit linear_ce step (bf16, the first T and V): where it goes."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    T, V = args.tokens[0], args.vocab[0]
    step = _linear_ce_steps(T, V, args.hidden, torch.bfloat16, device, None)["shardkit"]
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20)
    text = f"shardkit linear_ce, T={T} V={V} H={args.hidden} bf16, one forward + backward\n{table}"
    print(text)
    (args.out / "linear_ce_profile.txt").write_text(text)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--vocab", type=int, nargs="+", default=[128000, 256000])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    p.add_argument("--hidden", type=int, default=4096, help="H of the linear_ce rows")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, required=True, help="directory for gpu_losses.json")
    p.add_argument("--profile", action="store_true", help="also profile one shardkit linear_ce step")
    p.add_argument("--smoke-on-cpu", action="store_true", help="tiny shapes on the CPU (tests the script)")
    args = p.parse_args(argv)
    # fp32 matmuls of the linear rows cost ~8x bf16's: the fp32 linear rows stop at the smaller T
    args.linear_max_tokens = {"bf16": max(args.tokens), "fp32": min(args.tokens)}
    if args.smoke_on_cpu:
        args.tokens, args.vocab, args.hidden, args.repeats = [8, 33], [50], 16, 2
        args.linear_max_tokens = {"bf16": 33, "fp32": 33}
    elif not torch.cuda.is_available():
        print("benchmarks.gpu_losses: no CUDA device here; nothing measured (use --smoke-on-cpu to test it)")
        # an empty result in --out, as benchmarks/gpu.py writes: `shardkit bench all` then succeeds on CPU
        config = {k: v for k, v in vars(args).items() if k != "out"}
        write_results("gpu_losses", {**config, "skipped": "no CUDA device"}, [], args.out)
        return
    rows = run(args)
    if args.profile and not args.smoke_on_cpu:
        _profile_linear(args)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    if torch.cuda.is_available() and not args.smoke_on_cpu:
        config["device"] = torch.cuda.get_device_name(0)
        config["torch"] = torch.__version__
    write_results("gpu_losses", {**config, "out": str(args.out)}, rows, args.out)


if __name__ == "__main__":
    main()
