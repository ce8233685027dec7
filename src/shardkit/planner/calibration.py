"""Calibration: measure this machine's lookup and communication speeds for the cost model.

``calibrate()`` times a pooled embedding lookup (the bytes of the rows it reads per second) and, given
a process group of more than one rank, an all-to-all (the bytes each rank sends per second). It
returns the default ``CostModel`` of the device with the measured constants replaced; pass it as
``Topology(cost_model=...)``. Every rank of the group gets the same constants (the slowest rank's).
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardkit.distributed.agreement import group_size
from shardkit.distributed.topology import get_local_size
from shardkit.planner.calibration_steps import measure_step_overheads
from shardkit.planner.cost_model import CostModel


def _median_seconds(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up: allocations, kernel selection
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_lookup_bw(
    device: torch.device,
    rows: int = 1 << 18,
    dim: int = 64,
    batch: int = 2048,
    pooling: int = 20,
    repeats: int = 5,
) -> float:
    """Bytes of embedding rows per second that a pooled lookup of uniform random ids reads on ``device``."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    weight = torch.randn(rows, dim, generator=gen).to(device)
    ids = torch.randint(0, rows, (batch * pooling,), generator=gen).to(device)
    offsets = torch.arange(0, batch * pooling, pooling, device=device)
    with torch.no_grad():
        seconds = _median_seconds(lambda: F.embedding_bag(ids, weight, offsets, mode="sum"), repeats, device)
    return ids.numel() * dim * weight.element_size() / seconds


def measure_all_to_all_bw(
    pg: Optional[dist.ProcessGroup], device: torch.device, nbytes: int = 1 << 22, repeats: int = 5
) -> float:
    """Bytes per second each rank sends (to the others) in an all-to-all of ``nbytes`` per rank."""
    world = group_size(pg)
    numel = max(world, nbytes // 4 // world * world)
    send = torch.ones(numel, device=device)
    recv = torch.empty_like(send)
    seconds = _median_seconds(lambda: dist.all_to_all_single(recv, send, group=pg), repeats, device)
    return numel * 4 * (world - 1) / world / seconds


def calibrate(
    compute_device: Optional[str] = None,
    pg: Optional[dist.ProcessGroup] = None,
    measure_comm: bool = True,
    base: Optional[CostModel] = None,
    measure_steps: bool = True,
    fit_report: Optional[Dict[str, Any]] = None,
    **sizes: int,
) -> CostModel:
    """A ``CostModel`` with this machine's lookup bandwidth and (on a group of > 1 rank)
    collective bandwidth and the fitted step constants.

    Args:
        compute_device: ``"cuda"`` or ``"cpu"`` (default: cuda when available).
        pg: the group to time the all-to-all on (default group when None and torch.distributed is
            initialized). Collective when it runs: every rank of the group must call ``calibrate``.
        measure_comm: False skips the communication measurement (and the step overheads, which need it).
        measure_steps: False skips timing training steps of synthetic sharded tables, which fits the
            fixed and per-id costs and the training step's lookup bandwidth (``step_overhead_s``,
            ``group_overhead_s``, ``shard_overhead_s``, ``id_overhead_s``, ``id_miss_s``,
            ``lookup_cache_bytes``, ``replica_grad_passes``, ``replica_row_s``, ``replica_value_s``,
            ``replica_group_s``, ``replica_dense_s``, ``lookup_group_s``, the lookup field;
            :mod:`shardkit.planner.calibration_steps`). Collective too.
        fit_report: a dict that, with ``measure_steps``, receives the fit's ``residual`` (root mean
            square relative error) and ``steps``: per timed configuration (``config``, a description),
            its measured and fitted seconds, to judge the fit by.
        base: the constants not measured (default ``CostModel.default(compute_device)``).
        sizes: ``rows``, ``dim``, ``batch``, ``pooling`` of the timed lookup (smaller is faster and
            noisier).

    The lookup bandwidth replaces ``hbm_lookup_bw`` on CUDA and ``ddr_lookup_bw`` on CPU;
    the all-to-all bandwidth replaces ``intra_node_bw`` when the
    group is one node, else ``cross_node_bw``.
    All ranks measure at the same time, so ranks sharing cores are measured sharing them (a machine
    running more ranks than cores gets the slower figures it will train at).
    """
    compute_device = compute_device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = (
        torch.device("cuda", torch.cuda.current_device()) if compute_device == "cuda" else torch.device("cpu")
    )
    model = base or CostModel.default(compute_device)
    lookup_field = "hbm_lookup_bw" if compute_device == "cuda" else "ddr_lookup_bw"
    distributed = dist.is_available() and dist.is_initialized() and group_size(pg) > 1
    if distributed:
        # all ranks measure at once: ranks that share cores (or memory bandwidth) are measured sharing them
        dist.barrier(group=pg)
    measured: Dict[str, Any] = {lookup_field: measure_lookup_bw(device, **sizes)}
    comm_field = None
    if measure_comm and distributed:
        world = group_size(pg)
        comm_field = "intra_node_bw" if get_local_size(world) == world else "cross_node_bw"
        measured[comm_field] = measure_all_to_all_bw(pg, device)
    if distributed:
        # every rank must plan with the same constants: keep the slowest rank's figures
        names = sorted(measured)
        values = torch.tensor([measured[n] for n in names], dtype=torch.float64)
        if dist.get_backend(pg) == "nccl":
            values = values.to(device)
        dist.all_reduce(values, op=dist.ReduceOp.MIN, group=pg)
        measured = dict(zip(names, values.tolist()))
    if measure_steps and comm_field is not None:
        fitted = measure_step_overheads(pg, device, model.replace(**measured))
        residual, fitted_s, configs, times = (
            fitted.pop(k) for k in ("residual", "fitted_s", "configs", "measured_s")
        )
        if fit_report is not None:
            fit_report.update(
                residual=residual,
                steps=[
                    {"config": c, "measured_s": t, "fitted_s": f} for c, t, f in zip(configs, times, fitted_s)
                ],
            )
        measured[lookup_field] = fitted.pop("lookup_bw")
        measured[comm_field] = fitted.pop("comm_bw")  # the dists' bytes, timed in the same rounds
        measured.update(fitted)
    return model.replace(**measured)


__all__ = ["calibrate", "measure_all_to_all_bw", "measure_lookup_bw"]
