"""The constants of the planner's cost model, in one place (see docs/planner/cost_model.md for the formulas).

Every estimated time is ``bytes / bandwidth`` plus a fixed overhead per lookup call. The defaults are
round figures for the hardware class (an H100-class GPU node with NVLink and a 100 Gb/s NIC; a CPU
node with gloo); :func:`shardkit.planner.calibrate` measures this machine's figures and returns a
``CostModel`` to use instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping

GB = 1e9
# ShardingType values (the planner layer's cost model names them as strings, as plans do)
_SHARDING_TYPES = (
    "data_parallel",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "table_column_wise",
    "grid_shard",
)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Speeds the estimators divide bytes by. Bandwidths in bytes/s, times in seconds.

    Attributes:
        hbm_lookup_bw: bytes of embedding rows a lookup reads per second from device memory.
        ddr_lookup_bw: the same from host memory by the CPU (the CPU kernels' speed).
        uvm_lookup_bw: the same from host memory by the GPU over PCIe (FUSED_UVM kernels).
        intra_node_bw: per-rank bandwidth of a collective among the ranks of one node.
        cross_node_bw: per-rank bandwidth of a collective whose ranks span nodes.
        bwd_compute_factor: backward lookup time (gradient scatter + fused optimizer) / forward.
        lookup_overhead_s: fixed cost of one lookup call on a shard (kernel launch, bookkeeping).
        cache_hit_rate: share of a caching kernel's lookups served by its cache when the table's
            ``CacheParams`` carry no ``CacheStatistics`` (with statistics: ``1 - expected_miss_rate``).
        disk_lookup_bw: bytes of rows per second an offloading kernel reads from its CPU backing
            file (the slow tier on CPU: random rows from the offload directory's disk or page cache).
        step_overhead_s: fixed seconds of every training step of the sharded modules, whatever the plan
            (the forward / backward plumbing common to all shardings), charged to every rank.
        group_overhead_s: sharding type -> fixed seconds per step that the type's group costs once a
            plan uses it at all (its input and output dists: collective launches and latencies, the
            splits exchange), charged to every rank, whether it holds a shard of the type or not.
        shard_overhead_s: sharding type -> fixed seconds per step of one shard of that type on the
            rank holding it (its lookup call, its share of the features' permutes and of the output
            dist's per-table work); a type not named costs ``lookup_overhead_s``.
        replica_grad_passes: passes over a data-parallel replica's whole table per step at
            ``ddr_lookup_bw`` / ``hbm_lookup_bw`` when its gradient is a table-sized buffer (zeroed,
            scattered into, all-reduced, read back): always with the DENSE kernel, with the FUSED
            kernel only when most rows are touched (its exchange then all-reduces the dense gradient).
        replica_row_s: seconds per row a FUSED data-parallel replica updates per step, beside the
            bytes: its backward gathers every rank's touched rows and gradients and applies all of
            them (``world x`` the rows its own ids touch), so this is paid per row of the global
            batch, on every rank alike.
        replica_value_s: seconds per value (row x column) of those gathered rows: unpacking the
            exchanged gradients, summing and applying them.
        replica_group_s: seconds per step per group of FUSED data-parallel tables (tables of one
            width and dtype share a lookup) whose backward takes the sparse way (the gather of every
            rank's touched rows, the counts riding in it or gathered first), charged to every rank.
        replica_dense_s: seconds per step per such group whose backward takes the dense way instead
            (most of its rows touched: ``estimators.dense_replica_groups``): the all-reduce of its
            dense gradient buffer (a collective, beside its bytes) and the buffer's fixed per-step
            work (flags, counts, the step of the flagged rows), charged to every rank in place of
            ``replica_group_s``. The part that grows with the table is ``replica_grad_passes``.
        replica_permute_s: seconds per step of a module's data-parallel tables whose lookup groups (one
            per width and dtype) do not hold their features in the module's order: every batch is
            permuted into group order before the lookups and the output columns back after
            (``shardkit.sharding.data_parallel``), charged to every rank
            (``estimators.permuted_replica_modules``).
        id_overhead_s: sharding type -> seconds per id a shard of that type looks up, beside the bytes
            terms (routing work per id: bucketizing, permuting, the input dist's per-id bookkeeping);
            a type not named costs nothing per id.
        id_miss_s: seconds per id whose row is not in the CPU's (or GPU's) cache, beside the bytes:
            the memory latency of a random row. A shard of ``S`` weight bytes misses with probability
            ``max(0, 1 - lookup_cache_bytes / max(S, F))`` (uniform ids over its rows; ``F`` the rank's
            share of all tables' bytes, ``estimators.rank_footprint_bytes``: its shards share the
            cache), so a table that fits the cache pays nothing and one much larger pays it on nearly
            every id. Offloading kernels are not charged it (their tiers have their own bandwidths).
        lookup_cache_bytes: the cache a rank's lookups are served from (the ``C`` above; calibrate()
            picks it among powers of two by the fit's residual).
        miss_latency_bytes: the bytes of a missed row that stream from memory in one ``id_miss_s``:
            a missed row of ``row_bytes`` (the shard's columns x bytes per value) costs
            ``id_miss_s x max(1, row_bytes / miss_latency_bytes)``. The CPU lookup kernel prefetches
            the row 16 ids ahead while summing this one, so a narrow row costs the memory latency
            (per id) and a wide one the time its bytes take (per byte): two column shards of half the
            width then miss about as much as the whole table, not twice as much. ``inf``: per id
            whatever the width.
        lookup_group_s: seconds per step of one lookup group on the rank holding it, for every sharding
            type but data-parallel (whose groups cost ``replica_group_s``): a rank's shards of one
            sharding type, width and dtype in one module share a lookup (one kernel call forward and
            backward, ``shardkit.sharding.embedding_lookup.group_shards``), so shards of many widths
            cost more than as many shards of one width (``shardkit.planner.estimators.lookup_group_keys``).
        lookup_group_bag_s: seconds per bag (output row) a lookup group of a sharded type serves on its
            rank per step, beside ``lookup_group_s``: each group is its own kernel call forward and
            backward over every bag of the batch the rank serves (the global batch), and its output
            block is copied into the rank's output and its gradient block out of it. Measured on 2 ranks:
            an extra table-wise group cost ~0.21 ms at a batch of 32 per rank (64 bags served) and
            ~0.53 ms at 1024 (2048 served).
        output_value_s: seconds per output value (pooled: bag x column; sequence: id x column) a
            shard produces per step, forward and backward, beside the bytes its output dist puts on
            the wire: the kernel writes each value and its backward reads its gradient, and the dist
            pads, copies and sums them locally. A row-wise shard writes partial sums for every bag of
            the global batch, of which only ``(W-1)/W`` cross the wire; this term charges all of them.
    """

    hbm_lookup_bw: float
    ddr_lookup_bw: float
    uvm_lookup_bw: float
    intra_node_bw: float
    cross_node_bw: float
    bwd_compute_factor: float = 2.0
    lookup_overhead_s: float = 10e-6
    cache_hit_rate: float = 0.9
    disk_lookup_bw: float = 1 * GB
    step_overhead_s: float = 0.0
    group_overhead_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    shard_overhead_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    replica_grad_passes: float = 0.0
    replica_row_s: float = 0.0
    replica_value_s: float = 0.0
    replica_group_s: float = 0.0
    replica_dense_s: float = 0.0
    replica_permute_s: float = 0.0
    id_overhead_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    id_miss_s: float = 0.0
    lookup_cache_bytes: float = 32 * 2**20
    miss_latency_bytes: float = float("inf")
    output_value_s: float = 0.0
    lookup_group_s: float = 0.0
    lookup_group_bag_s: float = 0.0

    def __post_init__(self) -> None:
        bandwidths = ("hbm_lookup_bw", "ddr_lookup_bw", "uvm_lookup_bw", "intra_node_bw", "cross_node_bw")
        for name in (*bandwidths, "disk_lookup_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CostModel.{name} must be positive, got {getattr(self, name)}")
        for name in ("lookup_cache_bytes", "miss_latency_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CostModel.{name} must be positive, got {getattr(self, name)}")
        for name in (
            "bwd_compute_factor",
            "lookup_overhead_s",
            "step_overhead_s",
            "replica_grad_passes",
            "replica_row_s",
            "replica_value_s",
            "replica_group_s",
            "replica_dense_s",
            "replica_permute_s",
            "id_miss_s",
            "output_value_s",
            "lookup_group_s",
            "lookup_group_bag_s",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CostModel.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("group_overhead_s", "shard_overhead_s", "id_overhead_s"):
            for sharding_type, seconds in getattr(self, name).items():
                if not seconds >= 0:
                    raise ValueError(f"CostModel.{name}[{sharding_type!r}] must be >= 0, got {seconds}")
        if not 0.0 <= self.cache_hit_rate <= 1.0:
            raise ValueError(f"CostModel.cache_hit_rate must be in [0, 1], got {self.cache_hit_rate}")
        # frozen: keep private copies, so that a caller's dict changed later cannot change the model
        object.__setattr__(self, "group_overhead_s", dict(self.group_overhead_s))
        object.__setattr__(self, "shard_overhead_s", dict(self.shard_overhead_s))
        object.__setattr__(self, "id_overhead_s", dict(self.id_overhead_s))

    def shard_overhead(self, sharding_type: str) -> float:
        """Fixed seconds per step of one shard of ``sharding_type`` (``shard_overhead_s``, else
        ``lookup_overhead_s``)."""
        return self.shard_overhead_s.get(sharding_type, self.lookup_overhead_s)

    def lookup_group_cost(self, bags: float) -> float:
        """Seconds per step of one lookup group serving ``bags`` bags on its rank: ``lookup_group_s +
        bags x lookup_group_bag_s``."""
        return self.lookup_group_s + bags * self.lookup_group_bag_s

    def miss_rate(self, shard_bytes):
        """Share of a shard's lookups whose row is not in ``lookup_cache_bytes`` of cache (uniform ids over
        its rows): ``max(0, 1 - lookup_cache_bytes / shard_bytes)``; a float or a float64 tensor of
        shards' weight bytes, or the bytes competing for the cache (the estimator passes the larger of a
        shard's and its rank's share of all tables'); an empty shard misses nothing."""
        if isinstance(shard_bytes, (int, float)):
            return max(0.0, 1.0 - self.lookup_cache_bytes / shard_bytes) if shard_bytes > 0 else 0.0
        return (1.0 - self.lookup_cache_bytes / shard_bytes.clamp(min=1e-30)).clamp(min=0.0)

    def miss_cost(self, row_bytes):
        """Seconds per id whose row of ``row_bytes`` misses the cache: ``id_miss_s x max(1, row_bytes /
        miss_latency_bytes)`` (the latency, or the row's bytes when they take longer); a float or a
        float64 tensor of shards' row bytes."""
        if isinstance(row_bytes, (int, float)):
            return self.id_miss_s * max(1.0, row_bytes / self.miss_latency_bytes)
        return self.id_miss_s * (row_bytes / self.miss_latency_bytes).clamp(min=1.0)

    def plan_overhead(
        self, sharding_types, replica_groups: int = 0, dense_groups: int = 0, permuted_modules: int = 0
    ) -> float:
        """Seconds per step every rank pays for a plan using ``sharding_types``: the step's own
        overhead plus each type's group overhead (once per type), plus per group of FUSED data-parallel
        tables (``replica_groups``, ``shardkit.planner.estimators.replica_groups``) ``replica_dense_s``
        for the ``dense_groups`` of them that take the dense way
        (``shardkit.planner.estimators.dense_replica_groups``) and ``replica_group_s`` for the others,
        plus ``replica_permute_s`` per module whose data-parallel features are permuted into group
        order (``permuted_modules``, ``shardkit.planner.estimators.permuted_replica_modules``)."""
        types = set(sharding_types)
        return (
            self.step_overhead_s
            + sum(self.group_overhead_s.get(t, 0.0) for t in types)
            + (replica_groups - dense_groups) * self.replica_group_s
            + dense_groups * self.replica_dense_s
            + permuted_modules * self.replica_permute_s
        )

    @classmethod
    def default(cls, compute_device: str) -> CostModel:
        """The default constants for ``compute_device`` (``"cuda"`` or ``"cpu"``)."""
        if compute_device == "cpu":
            return cls(
                hbm_lookup_bw=5 * GB,  # unused: a CPU rank has no HBM
                ddr_lookup_bw=5 * GB,  # random 64-256 B rows from DRAM, one core per rank
                uvm_lookup_bw=5 * GB,
                intra_node_bw=2 * GB,  # gloo over loopback TCP
                cross_node_bw=1.25 * GB,  # 10 Gb/s ethernet
                lookup_overhead_s=20e-6,
                # a sharding type's group runs its own gloo collectives every step (splits, ids, pooled
                # rows forward and backward): calibrate() fitted 0-16 ms per type (most 2-15) on a loaded
                # 2-core machine (2 and 4 ranks); 2 ms is a round figure at the low end
                # data-parallel makes one collective a step (the dense kernel's all-reduce; a fused
                # replica's two all-gathers are replica_group_s) where the others make about four
                # (splits, ids, pooled rows forward and backward): a quarter of that figure
                group_overhead_s={t: 0.5e-3 if t == "data_parallel" else 2e-3 for t in _SHARDING_TYPES},
                # a fused replica's update of every rank's touched rows: refitting the seventh
                # session's idle calibration timings (2 and 4 ranks on 2 cores) gave 0.6-1.7 us per
                # row of 64 values; a group's two gloo all-gathers, about a millisecond. Round figures
                replica_row_s=0.2e-6,
                replica_value_s=5e-9,
                replica_group_s=1e-3,
                # a group on the dense way all-reduces instead of gathering: one collective too, so
                # the same round figure (the default model's estimates as before this constant)
                replica_dense_s=1e-3,
            )
        return cls(
            hbm_lookup_bw=1000 * GB,  # about a third of H100 peak: random rows, not streaming
            ddr_lookup_bw=20 * GB,
            uvm_lookup_bw=25 * GB,  # PCIe 4 x16, effective
            intra_node_bw=150 * GB,  # NVLink all-to-all, per rank
            cross_node_bw=12.5 * GB,  # 100 Gb/s NIC per rank
            lookup_overhead_s=10e-6,
        )

    def replace(self, **changes: Any) -> CostModel:
        """A copy with some constants changed (e.g. the ones :func:`calibrate` measured)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, float]:
        return dataclasses.asdict(self)


__all__ = ["GB", "CostModel"]
