"""The synthetic training steps ``calibrate()`` times (``calibration_steps`` times them and fits the
cost model's constants to them).

The configurations (``calibration_configs``) are synthetic, never the model being planned: tiny tables
(``BATCH`` bags of one id) of each type alone at ``COUNTS`` shards per rank, table-wise with each other
type and all four together (the fixed costs); table-wise tables of 1 to ``BIG_BYTES`` at ``BIG_BATCH``
bags of ``BIG_POOLING`` ids, and at widths 16 and 128 (per id, per miss and per byte costs), two of the
wide ones a rank (a rank's footprint past any one table: the miss term's second size); row- and
column-wise tables of ``BIG_BYTES`` / 4 and ``BIG_BYTES`` (their routing per id); one data-parallel table of
``BIG_BYTES`` / 4 at ``BATCH`` bags of one id and at ``BIG_BATCH`` bags of ``BIG_POOLING`` ids (its
per-id work and its update of every rank's touched rows), the same bytes at 16 columns and one of
``BIG_BYTES`` at 128 (the update per row against per value, in and out of the caches), one whose rows
are nearly all touched, at two sizes (the dense all-reduce's fixed cost against its table-sized
passes), a group of small replicas that fit the caches at a batch touching thousands of their rows
(the update per row and value where no miss pays for it), and 4 and 16 tiny replicas of as many
widths (one lookup group each), at ``BATCH`` bags (the sparse way) and at ``DENSE_BATCH`` (the dense
way), and 8 tiny replicas of 4 widths in turn at both batches (interleaved groups); ``GROUP_TABLES``
small tables of 3 widths in turn, table-wise, row-wise and data-parallel, beside the same sharded tables
at one width, at ``GROUP_BATCHES`` bags (lookup groups as models have them: their cost and its cost per
bag); 16 one-width tiny tables at ``BIG_BATCH`` bags. How the other fixed costs grow with the batch is
measured only through the per-id terms.
"""

from __future__ import annotations

import dataclasses
from typing import List, Tuple

TYPES = ("table_wise", "row_wise", "column_wise", "data_parallel")
# the lookup-group steps: GROUP_TABLES tables of GROUP_ROWS rows a step, at each of GROUP_BATCHES bags
GROUP_TABLES, GROUP_ROWS, GROUP_BATCHES = 24, 1000, (64, 256)
COUNTS = (1, 4, 16, 48)  # shards of one type per rank in the tiny steps the per-shard cost is fitted from
DIM = 8  # columns per rank's shard of the tiny tables
BATCH = 32  # bags per rank of the tiny tables, one id each: the bytes terms stay negligible
DENSE_BATCH = 256  # bags of one id per rank that touch most rows of a tiny replica (64 per rank)
MIB = 1 << 20
BIG_BYTES = 64 * MIB  # the largest lookup table (beyond a CPU's per-core caches)
BIG_DIM, BIG_BATCH, BIG_POOLING = 64, 512, 20
# rows of each table of the small-replica step: 8 x 4096 x 16 fp32 (256 KiB each, in every cache size
# the fit tries), whose 256 ids a rank touch ~250 rows each (2000 of the group's 32768: the sparse way)
SMALL_REPLICA_ROWS = 4096


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """A calibration step: one table per entry of ``types`` (that sharding), each of ``rows`` rows and
    ``dim`` columns per shard (a column-wise table has ``dim`` x world columns; table ``i`` has
    ``i x dim_step`` more: tables of different widths are separate lookup groups), ``batch`` bags of
    ``pooling`` uniform random ids per rank and table. ``cycle`` > 0: table ``i`` has ``(i % cycle) x
    dim_step`` more columns instead (the widths repeat: lookup groups that interleave the features)."""

    types: Tuple[str, ...]
    rows: int
    dim: int = DIM
    batch: int = BATCH
    pooling: int = 1
    dim_step: int = 0
    cycle: int = 0

    def width(self, index: int) -> int:
        """Columns per shard of table ``index``."""
        return self.dim + (index % self.cycle if self.cycle else index) * self.dim_step


def calibration_configs(world: int, big_bytes: int = BIG_BYTES) -> List[StepConfig]:
    """The steps the constants are fitted from (module doc). ``big_bytes`` scales the large tables
    (tests use small ones)."""
    tiny_rows = 64 * world
    tw = ("table_wise",) * world  # one table-wise table per rank
    configs = [
        StepConfig((t,) * (k * world if t == "table_wise" else k), tiny_rows) for t in TYPES for k in COUNTS
    ]
    configs += [StepConfig(tw + (t,), tiny_rows) for t in TYPES if t != "table_wise"]
    configs.append(StepConfig(tw + tuple(t for t in TYPES if t != "table_wise"), tiny_rows))
    row_bytes = BIG_DIM * 4
    big = dict(batch=BIG_BATCH, pooling=BIG_POOLING)
    for shift in (6, 4, 2, 0):  # 1/64 .. 1 x big_bytes: in and out of the caches
        configs.append(StepConfig(tw, max(64, (big_bytes >> shift) // row_bytes), BIG_DIM, **big))
    # a narrow and a wide table of the same bytes: per id against per byte (three widths, so one noisy
    # step cannot make the bytes look free)
    configs.append(StepConfig(tw, big_bytes // 64, 16, **big))
    configs.append(StepConfig(tw, big_bytes // 512, 128, **big))
    # the wide table at 4x the bags: the slope of a step in its ids at the large batches planners are
    # given (plan_quality's few_large: 1024-2048 bags of 20 ids). Without it the per-id and per-byte
    # terms were set by 512-bag steps and the tiny steps' fixed costs alone, and a fit that put the
    # fixed costs low (noisy tiny steps) extrapolated a 4x larger batch 1.4x too slow
    configs.append(StepConfig(tw, big_bytes // 512, 128, batch=4 * BIG_BATCH, pooling=BIG_POOLING))
    # two such tables a rank: the misses of a rank whose shards share its caches (the miss term prices
    # a shard by at least the rank's share of all tables' bytes, estimators.rank_footprint_bytes: here
    # 2 x big_bytes, the one size past big_bytes, which the cache size and the per-miss cost need to be
    # told apart once the row- and column-wise steps' halves are priced at their whole tables)
    configs.append(StepConfig(tw * 2, big_bytes // 512, 128, **big))
    # one id per bag at many bags: the pooled rows sent (bags x columns) against the ids and bytes read
    # (at 20 ids per bag the dists' bytes are a fixed mix of the two; the tiny steps have too few)
    many_bags = dict(batch=BIG_BATCH * 8, pooling=1)
    configs.append(StepConfig(tw, max(64, (big_bytes >> 2) // row_bytes), BIG_DIM, **many_bags))
    # the same as one row-wise table: every rank writes partial sums for all the bags and sends
    # (W-1)/W of them, so the output values' local work and their wire bytes separate
    configs.append(StepConfig(("row_wise",), max(64, (big_bytes >> 2) // row_bytes), BIG_DIM, **many_bags))
    for shift in (2, 0):  # two sizes each: one timed step alone would carry its noise into the fit
        rows = max(64, (big_bytes >> shift) // row_bytes)
        configs.append(StepConfig(("row_wise",) * world, rows, BIG_DIM, **big))
        configs.append(StepConfig(("column_wise",) * world, rows, max(1, BIG_DIM // world), **big))
    configs.append(StepConfig(("data_parallel",), max(64, big_bytes // 4) // row_bytes, BIG_DIM))
    configs.append(StepConfig(("data_parallel",), max(64, big_bytes // 4) // row_bytes, BIG_DIM, **big))
    # the fused replica's update, per row applied against per value (a narrow and a wide table), in and
    # out of the caches (the wide one of big_bytes), and a table small enough that most rows are
    # touched (its exchange all-reduces the dense gradient: the table-sized passes)
    configs.append(StepConfig(("data_parallel",), max(64, big_bytes // 4) // 64, 16, **big))
    configs.append(StepConfig(("data_parallel",), max(64, big_bytes // 512), 128, **big))
    configs.append(StepConfig(("data_parallel",), 2048, BIG_DIM, **big))
    # the same way at a quarter of the rows: the dense all-reduce's fixed cost (a collective, the
    # flags and counts; replica_dense_s) against its passes over the table (replica_grad_passes),
    # which one size alone cannot tell apart (one step made them 893 passes of a 512 KiB table)
    configs.append(StepConfig(("data_parallel",), 512, BIG_DIM, **big))
    # a group of small replicas (one width) that fit the caches, at a batch touching thousands of
    # their rows on the sparse way: the update per row and value where no miss pays for it (the
    # large replicas above miss, so their per-row cost could go to the miss term, and the tiny ones
    # touch a few dozen rows); the small tables of real models (plan_quality's demo and many_small)
    configs.append(
        StepConfig(("data_parallel",) * 8, SMALL_REPLICA_ROWS, 16, batch=BIG_BATCH // 4, pooling=2)
    )
    # replicas of different widths: one lookup group each, two all-gathers each in backward
    configs += [StepConfig(("data_parallel",) * k, tiny_rows, dim_step=DIM) for k in (4, 16)]
    # the same replicas at DENSE_BATCH bags, which touch most of their rows: each group takes the dense
    # way (its own all-reduce, flags and counts: replica_dense_s). Without them the dense way was seen
    # only in the two large-batch steps above, where the per-id terms could take its fixed cost: fits
    # put replica_dense_s at 0 and estimated 4 dense groups of 128-row tables at 256 bags at 0.8 ms,
    # measured 2.9 ms (a dense group costs about what a sparse one does, ~0.6 ms at 2 ranks)
    configs += [
        StepConfig(("data_parallel",) * k, tiny_rows, dim_step=DIM, batch=DENSE_BATCH) for k in (4, 16)
    ]
    # 8 tiny replicas of 4 widths in turn (8, 16, 24, 32, 8, ...) at both batches: the same 4 groups,
    # their features interleaved, so every batch is permuted into group order and the output columns
    # back (replica_permute_s). Without them a data-parallel plan of the demo's interleaved widths was
    # estimated 20-30 % below its measured step in plan_quality (twentieth session)
    configs += [
        StepConfig(("data_parallel",) * 8, tiny_rows, dim_step=DIM, cycle=4, batch=b)
        for b in (BATCH, DENSE_BATCH)
    ]
    # lookup groups as models have them: small tables (GROUP_ROWS rows) of 3 widths in turn (8, 16, 24:
    # three groups a rank, their features interleaved), table-wise (12 a rank) and row-wise (24), beside
    # the same tables at one width (one group), at GROUP_BATCHES bags of 2 ids: a group's cost and its
    # cost per bag (lookup_group_s, lookup_group_bag_s). Until the twenty-third session these steps held
    # one table per width at 4 and 16 widths a rank: their extra groups cost ~0.12 ms each at 2 ranks,
    # the groups of the demo's and many_small's plans (3 widths, 2-16 tables each) ~0.2-0.3 ms, and the
    # calibrated estimates of those plans were 10-20 % low at 2 and 4 ranks (docs/planner/calibration.md)
    group_tables = dict(rows=GROUP_ROWS, pooling=2)
    interleaved = dict(dim=8, dim_step=8, cycle=3)
    for batch in GROUP_BATCHES:
        for types in (tw * (GROUP_TABLES // 2), ("row_wise",) * GROUP_TABLES):
            configs.append(StepConfig(types, batch=batch, **interleaved, **group_tables))
            configs.append(StepConfig(types, dim=16, batch=batch, **group_tables))
        # the same as replicas, of two sizes (the update of their touched rows in and out of the
        # smaller caches): data-parallel plans of small tables were estimated 15-20 % low without them
        for rows in (GROUP_ROWS, 8 * GROUP_ROWS):
            configs.append(
                StepConfig(("data_parallel",) * GROUP_TABLES, rows, batch=batch, pooling=2, **interleaved)
            )
    # 16 tiny tables of one width at BIG_BATCH bags: the fixed costs at a large batch
    configs.append(StepConfig(tw * 16, tiny_rows, batch=BIG_BATCH))
    return configs


def describe(config: StepConfig) -> str:
    """``"8 x row_wise 4096x64 b512 p20"``: a configuration in a line."""
    kinds = ", ".join(f"{config.types.count(t)} {t}" for t in TYPES if t in config.types)
    widths = f"{config.dim}..{config.width(len(config.types) - 1)}" if config.dim_step else f"{config.dim}"
    if config.cycle:
        widths = f"{config.dim}..{config.width(config.cycle - 1)} x{len(config.types) // config.cycle}"
    return f"{kinds}: {config.rows}x{widths} b{config.batch} p{config.pooling}"


__all__ = [
    "BATCH",
    "BIG_BATCH",
    "BIG_BYTES",
    "BIG_DIM",
    "BIG_POOLING",
    "COUNTS",
    "DENSE_BATCH",
    "DIM",
    "GROUP_BATCHES",
    "GROUP_ROWS",
    "GROUP_TABLES",
    "MIB",
    "SMALL_REPLICA_ROWS",
    "StepConfig",
    "TYPES",
    "calibration_configs",
    "describe",
]
