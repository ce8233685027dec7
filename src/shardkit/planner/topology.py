"""Topology: the ranks a plan places tables on, their memory, and the speeds between them."""

from __future__ import annotations

import dataclasses
from typing import Optional

from shardkit.planner.cost_model import CostModel

GIB = 1 << 30

# Per-rank memory when the caller gives none: an 80 GB GPU less what the runtime keeps, and the host
# memory share of one rank; a CPU rank computes from host memory and has no HBM.
_DEFAULT_HBM = {"cuda": 64 * GIB, "cpu": 0}
_DEFAULT_DDR = {"cuda": 128 * GIB, "cpu": 32 * GIB}


@dataclasses.dataclass
class Topology:
    """World size, ranks per node, compute device, memory per rank and bandwidths.

    Args:
        world_size: number of ranks.
        compute_device: ``"cuda"`` (tables in HBM, or in DDR for the UVM kernels) or ``"cpu"``
            (tables in DDR).
        local_world_size: ranks per node (default: all ranks on one node); must divide world_size.
        hbm_cap, ddr_cap: bytes of device / host memory per rank available to the plan.
        disk_cap: bytes per rank of the CPU offload tier (the disk under the offload directory),
            where the offloading kernels (``fused_uvm``, ``fused_uvm_caching``, ``quant_uvm*``) keep a
            CPU table and its optimizer state; None: not limited (the storage itself checks the free
            space when it creates its files). Unused on CUDA, whose slow tier is DDR.
        cost_model: speeds of lookups and collectives (default :meth:`CostModel.default`).
        intra_node_bw, cross_node_bw: override the cost model's collective bandwidths (bytes/s).

    Ranks are numbered node by node, as torchrun does: node ``h`` holds ranks
    ``h * local_world_size ... (h + 1) * local_world_size - 1``.
    """

    world_size: int
    compute_device: str = "cuda"
    local_world_size: Optional[int] = None
    hbm_cap: Optional[int] = None
    ddr_cap: Optional[int] = None
    disk_cap: Optional[int] = None
    cost_model: Optional[CostModel] = None
    intra_node_bw: Optional[float] = None
    cross_node_bw: Optional[float] = None

    def __post_init__(self) -> None:
        if self.compute_device not in _DEFAULT_HBM:
            raise ValueError(f"Topology: unknown compute_device {self.compute_device!r}; known: cuda, cpu")
        if self.world_size < 1:
            raise ValueError(f"Topology: world_size must be >= 1, got {self.world_size}")
        if self.local_world_size is None:
            self.local_world_size = self.world_size
        if self.local_world_size < 1 or self.world_size % self.local_world_size != 0:
            raise ValueError(
                f"Topology: local_world_size {self.local_world_size} does not divide "
                f"world_size {self.world_size}"
            )
        if self.hbm_cap is None:
            self.hbm_cap = _DEFAULT_HBM[self.compute_device]
        if self.ddr_cap is None:
            self.ddr_cap = _DEFAULT_DDR[self.compute_device]
        if self.hbm_cap < 0 or self.ddr_cap < 0:
            raise ValueError(f"Topology: negative memory (hbm_cap={self.hbm_cap}, ddr_cap={self.ddr_cap})")
        if self.disk_cap is not None and not self.disk_cap >= 0:
            raise ValueError(f"Topology: disk_cap must be >= 0 bytes or None, got {self.disk_cap}")
        base = self.cost_model or CostModel.default(self.compute_device)
        overrides = {
            k: v
            for k, v in (("intra_node_bw", self.intra_node_bw), ("cross_node_bw", self.cross_node_bw))
            if v is not None
        }
        self.cost_model = base.replace(**overrides)
        self.intra_node_bw = self.cost_model.intra_node_bw
        self.cross_node_bw = self.cost_model.cross_node_bw

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def collective_bw(self) -> float:
        """Bandwidth of a collective over all ranks: cross-node as soon as the world spans nodes."""
        return self.intra_node_bw if self.num_nodes == 1 else self.cross_node_bw

    @property
    def disk_free(self) -> float:
        """Bytes of the CPU offload tier per rank (``disk_cap``; infinite when not limited)."""
        return float("inf") if self.disk_cap is None else float(self.disk_cap)

    def host_ranks(self, host: int) -> range:
        return range(host * self.local_world_size, (host + 1) * self.local_world_size)


__all__ = ["GIB", "Topology"]
