"""Storage reservation: the memory of each rank that the tables may not use.

Every rank also holds the model's dense part (the parameters no sharder handles, replicated for data
parallelism, with their gradients and optimizer state) and transient buffers (activations, the
allocator's fragmentation). The heuristic reserves both before the tables are placed.
"""

from __future__ import annotations

from typing import List, Sequence, Set, Tuple

from torch import nn

from shardkit.planner.enumerators import shardable_modules
from shardkit.planner.errors import PlannerError, format_bytes
from shardkit.planner.topology import Topology
from shardkit.sharding.types import ModuleSharder


def dense_parameter_bytes(module: nn.Module, sharders: Sequence[ModuleSharder[nn.Module]]) -> int:
    """Bytes of the parameters of ``module`` outside the submodules the sharders handle."""
    sharded: Set[int] = set()
    for _, sub, _ in shardable_modules(module, sharders):
        sharded.update(id(p) for p in sub.parameters())
    return sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in sharded)


class HeuristicalStorageReservation:
    """Reserve ``percentage`` of every rank's memory plus ``dense_factor`` x the dense parameters.

    Args:
        percentage: share of each rank's HBM and DDR kept for activations and fragmentation.
        dense_factor: copies of the dense parameters each rank holds (weights, gradients and two
            Adam states: 4).

    The dense part lives in the compute device's memory (HBM on CUDA, DDR on CPU).
    """

    def __init__(self, percentage: float = 0.15, dense_factor: float = 4.0) -> None:
        if not 0.0 <= percentage < 1.0:
            raise ValueError(f"storage reservation percentage must be in [0, 1), got {percentage}")
        if dense_factor < 0:
            raise ValueError(f"dense_factor must be >= 0, got {dense_factor}")
        self.percentage = percentage
        self.dense_factor = dense_factor

    def reserve(
        self, topology: Topology, module: nn.Module, sharders: Sequence[ModuleSharder[nn.Module]]
    ) -> Tuple[List[float], List[float]]:
        """``(hbm, ddr)`` bytes left for the tables on each rank, one entry per rank."""
        keep = 1.0 - self.percentage
        hbm, ddr = topology.hbm_cap * keep, topology.ddr_cap * keep
        dense = self.dense_factor * dense_parameter_bytes(module, sharders)
        on_gpu = topology.compute_device == "cuda"
        pool, kind = (hbm, "HBM") if on_gpu else (ddr, "DDR")
        if dense > pool:
            raise PlannerError(
                f"the dense part of the model needs {format_bytes(dense)} of {kind} per rank "
                f"({self.dense_factor:g} x its parameters), more than the {format_bytes(pool)} left "
                f"after reserving {self.percentage:.0%}"
            )
        if on_gpu:
            hbm -= dense
        else:
            ddr -= dense
        return [hbm] * topology.world_size, [ddr] * topology.world_size


__all__ = ["HeuristicalStorageReservation", "dense_parameter_bytes"]
