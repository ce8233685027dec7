"""Storage and performance estimators: fill in each shard's memory and its time per training step.

The formulas are documented in docs/planner/cost_model.md; the speeds come from the topology's
``CostModel``. Notation, per step: ``W`` ranks, ``L`` ranks per node, ``b`` / ``i`` the bags / ids
one rank's local batch brings for the table (``TableInfo.bags`` / ``.ids``), ``B = W b`` and
``I = W i`` the global ones, a shard of ``r x c`` values of ``e`` bytes.

Every estimate is linear in ``r x c``, ``r``, ``c`` and 1 (a row-split shard receives the share
``r / rows`` of the ids, so its id count is linear in ``r``). The estimators therefore compute four
coefficients per option and quantity in Python, and evaluate all shards of all options in one
vectorized step: 1000 tables x 64 ranks cost milliseconds, not a torch call per shard.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from shardkit.kernels.offload.narrow_state import NARROW_STATE_BYTES, keep_narrow_state
from shardkit.kernels.offload.slot_map import HASH_BYTES_PER_SLOT, SLOT_BOOKKEEPING_BYTES, choose_slot_map
from shardkit.modules.embedding_configs import data_type_to_dtype
from shardkit.planner.topology import Topology
from shardkit.planner.types import CACHING_KERNELS, OFFLOAD_KERNELS, ShardingOption, TableInfo
from shardkit.sharding.cache_params import DEFAULT_CACHE_LOAD_FACTOR
from shardkit.sharding.types import EmbeddingComputeKernel, ShardingType

# a caching kernel's default share of the table's rows in its fast-tier cache (the table in the slow tier)
CACHE_LOAD_FACTOR = DEFAULT_CACHE_LOAD_FACTOR

_K = EmbeddingComputeKernel
_CACHING = CACHING_KERNELS
_UVM = OFFLOAD_KERNELS - CACHING_KERNELS
# a grid's column blocks are row-split too: each block sees every id, each of its shards its rows' share
_ROW_SPLIT = {ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value, ShardingType.GRID_SHARD.value}
_DP = ShardingType.DATA_PARALLEL.value

# A linear form: coefficients of (r x c, r, c, 1).
Linear = Tuple[float, float, float, float]


def _scale(a: Linear, k: float) -> Linear:
    return (a[0] * k, a[1] * k, a[2] * k, a[3] * k)


def _add(*forms: Linear) -> Linear:
    return tuple(sum(parts) for parts in zip(*forms))  # type: ignore[return-value]


def _ids(o: ShardingOption, world: int) -> Linear:
    """Ids a shard looks up per step: all the table's (a row split: its ``r / rows`` share);
    a data-parallel replica only its own rank's."""
    t = o.table
    if o.sharding_type == _DP:
        return (0.0, 0.0, 0.0, t.ids)
    if o.sharding_type in _ROW_SPLIT:
        return (0.0, t.ids * world / t.rows, 0.0, 0.0)
    return (0.0, 0.0, 0.0, t.ids * world)


def _output_values(o: ShardingOption, world: int) -> Linear:
    """Output values a shard produces per step: ``c`` per bag when pooled (a row split produces
    partial sums for every bag), ``c`` per id looked up for a sequence table."""
    t = o.table
    if t.pooled:
        return (0.0, 0.0, t.bags if o.sharding_type == _DP else t.bags * world, 0.0)
    ids = _ids(o, world)
    return (ids[1], 0.0, ids[3], 0.0)  # ids x c: the r term becomes r x c, the constant becomes c


def distinct_rows(rows: int, ids: float) -> float:
    """Expected distinct rows ``ids`` uniform random ids touch in a table of ``rows`` rows:
    ``rows x (1 - (1 - 1/rows)^ids)`` (at most ``min(rows, ids)``)."""
    if rows <= 0 or ids <= 0:
        return 0.0
    if rows == 1:
        return 1.0
    return -rows * math.expm1(ids * math.log1p(-1.0 / rows))


def replica_exchange(table: TableInfo, world: int) -> Tuple[float, float, bool]:
    """``(rows applied, bytes received, dense)`` per step of a FUSED data-parallel replica of ``table``
    (``shardkit.sharding.replicated_fused_lookup``): each rank gathers every rank's touched rows and
    fp32 gradients (``world x touched x (cols + 2)`` 4-byte words, ``(world - 1)`` ranks' of them from
    the others) and applies all ``world x touched`` rows; when that is not fewer words than the table's
    ``rows x (cols + 1)``, it all-reduces the dense gradient instead (``dense``: ``2 (W-1)/W`` of those
    words on the wire) and applies the distinct rows of the global batch. ``touched``: the distinct rows
    of one rank's ids (uniform over the rows)."""
    touched = distinct_rows(table.rows, table.ids)
    if world <= 1:
        return touched, 0.0, False
    if world * touched * (table.cols + 2) < table.rows * (table.cols + 1):
        return world * touched, 4.0 * (world - 1) * touched * (table.cols + 2), False
    received = 4.0 * 2.0 * (world - 1) / world * table.rows * (table.cols + 1)
    return distinct_rows(table.rows, world * table.ids), received, True


def replica_groups(options: Sequence[ShardingOption]) -> int:
    """Groups of FUSED data-parallel tables in a plan's ``options``: one per (module, width, bytes per
    value), as the sharded lookup groups tables (``shardkit.sharding.embedding_lookup.group_shards``)."""
    return len(_fused_replica_groups(options))


def dense_replica_groups(options: Sequence[ShardingOption], world: int) -> int:
    """Groups of FUSED data-parallel tables in a plan's ``options`` (``replica_groups``) whose backward
    takes the dense way (``CostModel.replica_dense_s``). The library decides per group, on the group's
    stacked table (``sharding.replicated_exchange.prefers_dense``): dense when gathering every rank's
    touched rows of the group (``world x touched x (cols + 2)`` words) is not fewer words than the
    dense buffer's ``rows x (cols + 1)``; here ``touched`` is the sum over the group's tables of the
    distinct rows one rank's uniform ids touch (``distinct_rows``), ``rows`` their rows."""
    if world <= 1:
        return 0
    dense = 0
    for (_, cols, _), tables in _fused_replica_groups(options).items():
        rows = sum(t.rows for t in tables)
        touched = sum(distinct_rows(t.rows, t.ids) for t in tables)
        dense += world * touched * (cols + 2) >= rows * (cols + 1)
    return dense


def permuted_replica_modules(options: Sequence[ShardingOption]) -> int:
    """Modules whose data-parallel tables in a plan's ``options`` do not hold their features in group
    order (``CostModel.replica_permute_s``): the sharded module looks up each (width, dtype) group of
    them in one call, groups in order of first appearance (``shardkit.sharding.embedding_lookup
    .received_keys``), so tables of interleaved widths make it permute every batch into that order and
    the output columns back (``shardkit.sharding.data_parallel``)."""
    by_module: dict = {}
    for o in options:
        if o.sharding_type == _DP:
            by_module.setdefault(o.table.module_path, []).append(o.table)
    permuted = 0
    for tables in by_module.values():
        keys = [(t.cols, t.element_size) for t in sorted(tables, key=lambda t: t.position)]
        grouped = [key for key in dict.fromkeys(keys) for _ in range(keys.count(key))]
        permuted += keys != grouped
    return permuted


def _fused_replica_groups(options: Sequence[ShardingOption]) -> dict:
    """(module, width, bytes per value) -> the tables of the plan's FUSED data-parallel options in that
    lookup group (each sharded module groups its own tables: ``sharding.embedding_lookup.group_shards``)."""
    groups: dict = {}
    for o in options:
        if o.sharding_type == _DP and o.compute_kernel == _K.FUSED.value:
            key = (o.table.module_path, o.table.cols, o.table.element_size)
            groups.setdefault(key, []).append(o.table)
    return groups


def lookup_group_keys(o: ShardingOption) -> List[Optional[tuple]]:
    """The lookup group each shard of ``o`` joins on its rank (``CostModel.lookup_group_s``): one per
    module, sharding type, shard width and dtype, as ``shardkit.sharding.embedding_lookup.group_shards``
    groups a rank's shards of one sharding (an offloaded shard is a group of its own); None for a
    data-parallel option (its groups are priced per plan, ``replica_group_s``)."""
    if o.sharding_type == _DP:
        return [None] * o.num_shards
    t = o.table
    keys: List[Optional[tuple]] = []
    for k, cols in enumerate(o.sizes[:, 1].tolist()):
        key = (t.module_path, o.sharding_type, int(cols), t.element_size)
        keys.append(key + (t.name, k) if o.compute_kernel in OFFLOAD_KERNELS else key)
    return keys


def rank_footprint_bytes(options: Sequence[ShardingOption], world: int) -> float:
    """A rank's share of the weight bytes of every table ``options`` cover (each table once, whatever its
    options): ``rows x cols x element_size / world`` a table, or the whole table where its only options
    are data-parallel (a replica is whole on every rank). The miss term prices a shard's ids by the
    larger of its own bytes and this: the lookups of all of a rank's shards share its caches, so a
    shard among others misses as the rank's footprint does (four 102 MB tables on 2 ranks measured
    alike table-wise and row-wise, 205 MB a rank either way, while the row-wise shards are half the
    size), and the share is known before placement, so the partitioner's sums stay additive (a table
    that may still be placed either way counts as sharded)."""
    tables: dict = {}
    for o in options:
        table, replicated = tables.get(id(o.table), (o.table, True))
        tables[id(o.table)] = (table, replicated and o.sharding_type == _DP)
    return sum(
        t.rows * t.cols * float(t.element_size) / (1 if replicated else max(world, 1))
        for t, replicated in tables.values()
    )


def lookup_group_bags(o: ShardingOption, world: int) -> float:
    """Bags (output rows) the lookup group of a shard of ``o`` serves on its rank per step
    (``CostModel.lookup_group_bag_s``): the global batch of its table's features when pooled (every
    sharded type pools every rank's bags of the features it holds), their ids when not."""
    t = o.table
    return (t.bags if t.pooled else t.ids) * world


def load_factor(o: ShardingOption) -> float:
    """The load factor of a caching option's cache (its ``cache_params``, else the default)."""
    params = o.cache_params
    return CACHE_LOAD_FACTOR if params is None or params.load_factor is None else params.load_factor


def cached_row_bytes(o: ShardingOption) -> Linear:
    """Bytes of one cached row, as a form in (r x c, r, c, 1) per row: its values (in the cache's
    ``precision`` when given) + the row's extra bytes + the optimizer state kept with it."""
    t = o.table
    e = float(t.element_size)
    precision = None if o.cache_params is None else o.cache_params.precision
    if precision is not None and t.output_bytes_per_value is None:  # a trainable table
        e = float(data_type_to_dtype(precision).itemsize)
    return (e + t.state_bytes_per_value, float(t.row_bytes + t.state_bytes_per_row), 0.0, 0.0)


def _cached_bytes_per_row(o: ShardingOption) -> float:
    """A cached row's bytes (:func:`cached_row_bytes`) at the option's widest shard."""
    per_value, per_row = cached_row_bytes(o)[:2]
    return per_value * float(o.sizes[:, 1].max()) + per_row if o.sizes.numel() else per_row


def narrow_state_bytes_per_row(o: ShardingOption) -> int:
    """Bytes a row of the table's optimizer state that a ``fused_uvm_caching`` cache on CPU keeps mapped for
    every row of the shard: a state of at most ``NARROW_STATE_BYTES`` bytes a row and none per value
    (row-wise Adagrad: 4), kept by :func:`~shardkit.kernels.offload.narrow_state.keep_narrow_state`'s rule
    (while within ``NARROW_SHARE`` of the cache's bytes: ``load_factor x`` a cached row's) unless
    ``$SHARDKIT_OFFLOAD_KEEP_NARROW_STATE`` says otherwise; else 0."""
    t = o.table
    if t.state_bytes_per_value or not 0 < t.state_bytes_per_row <= NARROW_STATE_BYTES:
        return 0
    kept = keep_narrow_state(float(t.state_bytes_per_row), load_factor(o) * _cached_bytes_per_row(o))
    return t.state_bytes_per_row if kept else 0


def cache_bookkeeping_bytes(o: ShardingOption) -> Linear:
    """A CPU cache's bookkeeping (kernels/offload/slot_map.py), a form per shard: its per-slot arrays
    (``SLOT_BOOKKEEPING_BYTES`` a slot) and its slot map, hashed (at most ``HASH_BYTES_PER_SLOT`` a slot)
    or, where :func:`~shardkit.kernels.offload.slot_map.choose_slot_map` keeps it dense (its rule at the
    option's largest shard, ``$SHARDKIT_OFFLOAD_SLOT_MAP``), 4 bytes a row of the shard."""
    lf = load_factor(o)
    rows = int(o.sizes[:, 0].max()) if o.sizes.numel() else 0
    kind, _ = choose_slot_map(None, rows, int(round(lf * rows)), int(math.ceil(_cached_bytes_per_row(o))))
    per_slot = SLOT_BOOKKEEPING_BYTES + (0 if kind == "dense" else HASH_BYTES_PER_SLOT)
    return (0.0, lf * per_slot + (4.0 if kind == "dense" else 0.0), 0.0, 0.0)


def _evaluate(
    options: Sequence[ShardingOption], coefficients: Callable[[ShardingOption], List[Linear]]
) -> List[torch.Tensor]:
    """``[k, q]`` values of the ``q`` linear forms ``coefficients(o)`` at each shard of each option."""
    counts = [o.num_shards for o in options]
    coefs = torch.tensor([coefficients(o) for o in options], dtype=torch.float64)  # [n, q, 4]
    sizes = torch.cat([o.sizes for o in options]).to(torch.float64)
    r, c = sizes[:, 0], sizes[:, 1]
    basis = torch.stack([r * c, r, c, torch.ones_like(r)], dim=1)  # [N, 4]
    per_shard = coefs.repeat_interleave(torch.tensor(counts), dim=0)  # [N, q, 4]
    values = (per_shard * basis[:, None, :]).sum(-1)  # [N, q]
    return list(values.split(counts))


class EmbeddingStorageEstimator:
    """Bytes of HBM, DDR and CPU offload disk per shard: weights + optimizer state (+ a dense gradient
    for the DENSE kernel) + the input and output buffers of one step.

    Where the weights and state live: the compute device's memory (HBM on CUDA, DDR on CPU) for FUSED /
    DENSE / QUANT. The offloading kernels keep them in the slow tier (DDR on CUDA, the offload disk on
    CPU); ``fused_uvm`` / ``quant_uvm`` keep nothing else in the fast tier, the caching kernels a cache of
    ``load_factor x r`` rows (values + the optimizer state of the cached rows) in it; on CPU,
    ``fused_uvm_caching`` also keeps its bookkeeping (:func:`cache_bookkeeping_bytes`: O(cache rows)
    with the hashed slot map) and, while small against its cache, a narrow optimizer state (row-wise
    Adagrad's 4 bytes a row) of every row mapped in DDR (:func:`narrow_state_bytes_per_row`).
    Buffers (ids in, output values and their gradients) always live in the compute device's memory.
    """

    def estimate(self, options: Sequence[ShardingOption], topology: Topology) -> None:
        if not options:
            return
        on_gpu = topology.compute_device == "cuda"
        world = topology.world_size

        def coefficients(o: ShardingOption) -> List[Linear]:
            t: TableInfo = o.table
            weights: Linear = (float(t.element_size), float(t.row_bytes), 0.0, 0.0)
            state: Linear = (float(t.state_bytes_per_value), float(t.state_bytes_per_row), 0.0, 0.0)
            if o.compute_kernel == _K.DENSE.value:
                state = _add(state, weights)  # the dense gradient, as large as the table
            table = _add(weights, state)
            output_bytes = (
                2 * t.element_size if t.output_bytes_per_value is None else t.output_bytes_per_value
            )
            buffers = _add(
                _scale(_ids(o, world), t.bytes_per_id), _scale(_output_values(o, world), output_bytes)
            )
            zero: Linear = (0.0, 0.0, 0.0, 0.0)
            fast = buffers
            if o.compute_kernel in _CACHING:
                fast = _add(buffers, _scale(cached_row_bytes(o), load_factor(o)))
            if not on_gpu and o.compute_kernel == _K.FUSED_UVM_CACHING.value:
                # a narrow optimizer state (row-wise Adagrad's one float a row) stays mapped in memory
                # for every row of the shard while small against the cache (narrow_state.py), and the
                # cache's slot map and per-slot arrays (slot_map.py)
                fast = _add(fast, (0.0, float(narrow_state_bytes_per_row(o)), 0.0, 0.0))
                fast = _add(fast, cache_bookkeeping_bytes(o))
            if not on_gpu:
                if o.compute_kernel in OFFLOAD_KERNELS:
                    return [zero, fast, table]
                return [zero, _add(table, buffers), zero]
            if o.compute_kernel in OFFLOAD_KERNELS:
                return [fast, table, zero]
            return [_add(buffers, table), zero, zero]

        for o, values in zip(options, _evaluate(options, coefficients)):
            o.hbm, o.ddr, o.disk = values[:, 0], values[:, 1], values[:, 2]


class EmbeddingPerfEstimator:
    """Seconds per training step per shard, split into compute and communication.

    compute = (1 + bwd_compute_factor) * (ids x c x e) / lookup_bw + shard_overhead(type)
              + ids x id_overhead_s[type] + output values x output_value_s
              + ids x max(0, 1 - lookup_cache_bytes / max(r c e, F)) x id_miss_s
                x max(1, c e / miss_latency_bytes)
              (the last: the memory latency, or for a wide row its bytes, of rows not in the cache,
              F the rank's share of all tables' bytes (rank_footprint_bytes); not for offloading kernels)
              (+ 3 x weights / lookup_bw for the DENSE kernel: the optimizer reads and writes the
              whole table and its dense gradient; + replica_grad_passes x weights / lookup_bw for a
              data-parallel replica with a table-sized gradient buffer: DENSE always, FUSED when its
              exchange is the dense all-reduce)
              + a FUSED data-parallel replica's update: rows applied x (replica_row_s + c x
              replica_value_s), the rows applied also counted by the miss term (``replica_exchange``)
    comm    = input dist (ids x 8 B / bw; 12 B with per-id weights)
              + output dist forward and backward, by sharding type:
              TABLE_WISE, COLUMN_WISE, TABLE_COLUMN_WISE: all-to-all of the shard's output values;
              ROW_WISE: reduce-scatter of B x c partial sums ((W-1)/W of them cross the wire);
              TABLE_ROW_WISE, GRID_SHARD (per column block): reduce-scatter within the node, then
              all-to-all of 1/L across nodes;
              DATA_PARALLEL: no forward communication; DENSE: the backward all-reduce of the gradient
              (2 (W-1)/W x weights); FUSED: the gather of every rank's touched rows and gradients, or
              the dense all-reduce when most rows are touched (``replica_exchange``).
    A sequence (unpooled) table's output values are ``c`` per id instead of ``c`` per bag, and its
    row splits send them back by all-to-all (nothing to reduce).

    lookup_bw: the fast tier's (``hbm_lookup_bw`` on CUDA, ``ddr_lookup_bw`` on CPU) for in-memory
    kernels; the slow tier's (``uvm_lookup_bw`` on CUDA, ``disk_lookup_bw`` on CPU) for ``fused_uvm`` /
    ``quant_uvm``; for a caching kernel the harmonic mix ``1 / (h / fast + (1 - h) / slow)`` with ``h``
    its expected hit rate: ``1 - stats.expected_miss_rate(load_factor)`` when its ``CacheParams`` carry
    ``CacheStatistics``, else ``CostModel.cache_hit_rate`` (recorded in ``ShardingOption.hit_rate`` and
    ``hit_rate_source``).
    """

    def estimate(self, options: Sequence[ShardingOption], topology: Topology) -> None:
        if not options:
            return
        cm = topology.cost_model
        world, local = topology.world_size, topology.local_world_size
        coll, intra, cross = topology.collective_bw, topology.intra_node_bw, topology.cross_node_bw
        on_cpu = topology.compute_device == "cpu"
        local_bw = cm.ddr_lookup_bw if on_cpu else cm.hbm_lookup_bw
        slow_bw = cm.disk_lookup_bw if on_cpu else cm.uvm_lookup_bw
        footprint = rank_footprint_bytes(options, world)

        def lookup_bw(o: ShardingOption) -> float:
            if o.compute_kernel not in OFFLOAD_KERNELS:
                o.hit_rate = o.hit_rate_source = None
                return local_bw
            if o.compute_kernel in _UVM:
                o.hit_rate, o.hit_rate_source = 0.0, "no cache"
                return slow_bw
            stats = None if o.cache_params is None else o.cache_params.stats
            if stats is not None:
                o.hit_rate, o.hit_rate_source = 1.0 - stats.expected_miss_rate(load_factor(o)), "statistics"
            else:
                o.hit_rate, o.hit_rate_source = cm.cache_hit_rate, "cost model"
            return 1.0 / (o.hit_rate / local_bw + (1.0 - o.hit_rate) / slow_bw)

        def coefficients(o: ShardingOption) -> List[Linear]:
            t = o.table
            e, bw = float(t.element_size), lookup_bw(o)
            ids = _ids(o, world)
            ids_x_c: Linear = (ids[1], 0.0, ids[3], 0.0)
            compute = _add(
                _scale(ids_x_c, (1.0 + cm.bwd_compute_factor) * e / bw),
                (0, 0, 0, cm.shard_overhead(o.sharding_type)),
            )
            compute = _add(compute, _scale(ids, cm.id_overhead_s.get(o.sharding_type, 0.0)))
            # every output value is written, and its gradient read, on the rank that computes it,
            # whatever share of it the output dist sends away (a row split: all bags' partial sums)
            compute = _add(compute, _scale(_output_values(o, world), cm.output_value_s))
            if o.compute_kernel == _K.DENSE.value:  # the dense optimizer's passes over table and gradient
                compute = _add(compute, (3.0 * e / bw, 0.0, 0.0, 0.0))
            # ids whose rows are read from the table's memory (the miss term's count)
            touching: Linear = ids
            # the replicated fused lookup serves the in-memory FUSED kernel only (sharders offer no
            # offloading kernel for a replica; any other keeps the table-sized gradient all-reduce)
            replica = o.sharding_type == _DP and o.compute_kernel == _K.FUSED.value
            exchange = 0.0
            if replica:
                # the fused replica's backward (replicated_fused_lookup): every rank applies every
                # rank's touched rows, after gathering them (or all-reducing the dense gradient)
                applied, exchange, dense = replica_exchange(t, world)
                per_row = cm.replica_row_s + t.cols * cm.replica_value_s
                compute = _add(compute, (0.0, 0.0, 0.0, applied * per_row))
                touching = _add(ids, (0.0, 0.0, 0.0, applied))
                if dense:  # the dense gradient buffer: zeroed, scattered into, read back
                    compute = _add(compute, (cm.replica_grad_passes * e / bw, 0.0, 0.0, 0.0))
            elif o.sharding_type == _DP:
                # a DENSE replica's gradient is a table-sized buffer all-reduced by the model's wrapper
                # (and so, in this model, any replica but a FUSED one)
                compute = _add(compute, (cm.replica_grad_passes * e / bw, 0.0, 0.0, 0.0))
            out_bytes = _scale(_output_values(o, world), e)
            input_dist = _scale(ids, t.bytes_per_id / coll)
            st = o.sharding_type
            if replica:
                comm = (0.0, 0.0, 0.0, exchange / coll)
            elif st == _DP:
                comm = (2.0 * (world - 1) / world * e / coll, 0.0, 0.0, 0.0)
            elif st == ShardingType.ROW_WISE.value and t.pooled:
                comm = _add(input_dist, _scale(out_bytes, 2.0 * (world - 1) / world / coll))
            elif st in (ShardingType.TABLE_ROW_WISE.value, ShardingType.GRID_SHARD.value) and t.pooled:
                per_byte = (local - 1) / local / intra + 1.0 / local / cross
                comm = _add(input_dist, _scale(out_bytes, 2.0 * per_byte))
            else:
                comm = _add(input_dist, _scale(out_bytes, 2.0 / coll))
            return [compute, comm, touching]

        for o, values in zip(options, _evaluate(options, coefficients)):
            o.compute, o.comm = values[:, 0], values[:, 1]
            if cm.id_miss_s > 0 and o.compute_kernel not in OFFLOAD_KERNELS:
                # not linear in the shard's size: each id misses the cache with probability
                # 1 - cache / (the bytes competing for it), evaluated per shard: its own weight bytes,
                # at least a rank's share of all tables' (rank_footprint_bytes)
                sizes = o.sizes.to(torch.float64)
                row_bytes = sizes[:, 1] * float(o.table.element_size)
                shard_bytes = sizes[:, 0] * row_bytes
                competing = torch.where(shard_bytes > 0, shard_bytes.clamp(min=footprint), shard_bytes)
                miss = cm.miss_rate(competing) * cm.miss_cost(row_bytes)
                o.compute = o.compute + values[:, 2] * miss


__all__ = [
    "CACHE_LOAD_FACTOR",
    "EmbeddingPerfEstimator",
    "EmbeddingStorageEstimator",
    "cache_bookkeeping_bytes",
    "cached_row_bytes",
    "dense_replica_groups",
    "distinct_rows",
    "load_factor",
    "lookup_group_bags",
    "rank_footprint_bytes",
    "lookup_group_keys",
    "permuted_replica_modules",
    "replica_exchange",
    "replica_groups",
]
