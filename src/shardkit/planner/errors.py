"""PlannerError: the plan does not fit, with the tables and the memory that did not."""

from __future__ import annotations

import dataclasses
from typing import List, Sequence


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: sizes in the planner's messages and printed plans."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclasses.dataclass
class UnplacedShard:
    """A shard no rank had room for: what it needed and the most any allowed rank had left (``disk``:
    the CPU offload tier of the offloading kernels, ``Topology.disk_cap``)."""

    table: str
    sharding_type: str
    compute_kernel: str
    shard_index: int
    hbm_needed: float
    ddr_needed: float
    hbm_free: float
    ddr_free: float
    disk_needed: float = 0.0
    disk_free: float = float("inf")

    def __str__(self) -> str:
        # the CPU offload tier is named only where the shard needs some of it
        disk_needed = f" + disk {format_bytes(self.disk_needed)}" if self.disk_needed > 0 else ""
        disk_free = ""
        if self.disk_needed > 0:
            free = format_bytes(self.disk_free) if self.disk_free != float("inf") else "unlimited"
            disk_free = f" + disk {free}"
        return (
            f"table {self.table!r} ({self.sharding_type}, {self.compute_kernel}) shard {self.shard_index} "
            f"needs HBM {format_bytes(self.hbm_needed)} + DDR {format_bytes(self.ddr_needed)}{disk_needed}; "
            f"the emptiest rank had HBM {format_bytes(self.hbm_free)} + "
            f"DDR {format_bytes(self.ddr_free)}{disk_free} free"
        )


class PlannerError(ValueError):
    """No plan fits the topology's memory (or the constraints leave a table no option).

    Attributes:
        unplaced: the shards that did not fit (empty when the error is not about memory).
    """

    def __init__(self, message: str, unplaced: Sequence[UnplacedShard] = ()) -> None:
        super().__init__(message)
        self.unplaced: List[UnplacedShard] = list(unplaced)

    @property
    def tables(self) -> List[str]:
        """Names of the tables that did not fit, in the order they were tried."""
        return list(dict.fromkeys(u.table for u in self.unplaced))


__all__ = ["PlannerError", "UnplacedShard", "format_bytes"]
