"""Sharded table state: dcp save / load, full_table, load_full_table, for every sharding type.

Every rank builds the same full tensors from fixed seeds and slices its local shards out of them by
the plan's metadata (plain indexing, independent of the code under test), so each check compares
with the full tensors directly.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from shardkit.sharding.sharded_state import (
    dtensor_shard_dim,
    full_table,
    load_full_table,
    load_state_value,
    to_state_value,
)
from shardkit.sharding.sharding_plan import (
    build_parameter_sharding,
    column_wise,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from shardkit.sharding.state_layout import row_state_layout, table_layout
from shardkit.testing import run_world

# (12, 8) splits evenly at 2, 3, 4 ranks the way DTensor does; (10, 7) splits unevenly (array_split
# rows [4, 3, 3] / [3, 3, 2, 2], not DTensor's [4, 4, 2] / [3, 3, 3, 1]); (2, 5) leaves empty row
# shards at 3 and 4 ranks.
TABLES = {"even": (12, 8), "uneven": (10, 7), "tiny": (2, 5)}


def _local_size(world):
    return 2 if world % 2 == 0 else world


def _skewed_rows(name, shape, local_size, world, device_type):
    """Row-wise with empty shards between full ones: rank 1 most rows, the last rank one, others none."""
    sizes = [0] * world
    sizes[1] = shape[0] - (1 if world > 2 else 0)
    if world > 2:
        sizes[-1] = 1
    return build_parameter_sharding("row_wise", shape, range(world), sizes=sizes)


def _generators(world):
    """Sharding type -> plan constructor for a world of ``world`` ranks."""
    last_host = world // _local_size(world) - 1
    return {
        "data_parallel": data_parallel(),
        "table_wise": table_wise(rank=world - 1),
        "row_wise": row_wise(),
        "column_wise": column_wise(ranks=list(range(world))),
        # more blocks than ranks, out of order: rank world-1 holds two
        "column_wise_multi": column_wise(ranks=[world - 1, *range(world)]),
        "row_wise_skewed": _skewed_rows,
        "table_row_wise": table_row_wise(host_index=last_host),
        "table_column_wise": table_column_wise(host_index=0),
    }


def _layouts(world):
    """(case name, table layout, per-row state layout) for every sharding type x table."""
    cases = []
    for kind, generate in _generators(world).items():
        for table, shape in TABLES.items():
            name = f"{kind}.{table}"
            sharding = generate(name, shape, _local_size(world), world, "cpu")
            cases.append(
                (
                    name,
                    table_layout(name, sharding, shape, world),
                    row_state_layout(name, sharding, shape, world),
                )
            )
    return cases


def _full(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _slice_local(full, layout, rank):
    """The local shards of ``rank``: plain slices of ``full`` (per_block: the block's column, [rows])."""
    out = []
    for md in layout.local_metadata(rank):
        index = tuple(slice(o, o + s) for o, s in zip(md.shard_offsets, md.shard_sizes))
        piece = full[index].clone()
        out.append(piece.reshape(layout.local_shape(md)))
    return out


def _states(name, layout, row_layout, seed):
    """Full tensors of one table: weight and Adam moment [rows, dim] (fp32, bf16), per-row sum."""
    return {
        f"{name}.weight": (_full(layout.global_shape, seed), layout),
        f"{name}.exp_avg": (_full(layout.global_shape, seed + 1, torch.bfloat16), layout),
        f"{name}.sum": (_full(row_layout.global_shape, seed + 2).abs(), row_layout),
    }


def _all_states(world):
    states = {}
    for i, (name, layout, row_layout) in enumerate(_layouts(world)):
        states.update(_states(name, layout, row_layout, seed=10 * i))
    return states


def _kind(value):
    if isinstance(value, ShardedTensor):
        return "ShardedTensor"
    placement = value.placements[0]
    return f"DTensor({type(placement).__name__}{getattr(placement, 'dim', '')})"


def _check_world(path):
    """Every rank: save, load into zeros, full_table, load_full_table, load_state_value."""
    rank, world = dist.get_rank(), dist.get_world_size()
    states = _all_states(world)
    local = {key: _slice_local(full, layout, rank) for key, (full, layout) in states.items()}
    saved = {key: to_state_value(local[key], layout) for key, (_, layout) in states.items()}
    kinds = {key: _kind(value) for key, value in saved.items()}
    for key, value in saved.items():
        if isinstance(value, DTensor) and dtensor_shard_dim(states[key][1], world) is not None:
            # the DTensor form is only right where dcp's offsets are the plan's
            (chunk,) = value.__create_chunk_list__()
            (md,) = states[key][1].local_metadata(rank)
            if math.prod(md.shard_sizes) > 0:  # an empty shard's offset carries nothing
                assert list(chunk.offsets) == md.shard_offsets and list(chunk.sizes) == md.shard_sizes, key
    dcp.save(saved, checkpoint_id=path)

    # the tables of a sharded module are parameters (requires_grad); dcp writes through the values
    fresh = {key: [nn.Parameter(torch.zeros_like(t)) for t in tensors] for key, tensors in local.items()}
    dcp.load(
        {key: to_state_value(fresh[key], layout) for key, (_, layout) in states.items()}, checkpoint_id=path
    )
    for key, tensors in local.items():
        assert all(torch.equal(a, b) for a, b in zip(fresh[key], tensors)), f"dcp round trip of {key}"

    for key, (full, layout) in states.items():
        everywhere = full_table(local[key], layout)
        assert torch.equal(everywhere, full) and everywhere.dtype == full.dtype, f"full_table of {key}"
        on_one = full_table(local[key], layout, dst=world - 1)
        assert (on_one is None) == (rank != world - 1), key
        assert on_one is None or torch.equal(on_one, full), key

        target = [torch.zeros_like(t) for t in local[key]]
        load_full_table(full, target, layout)
        assert all(torch.equal(a, b) for a, b in zip(target, local[key])), f"load_full_table of {key}"
        target = [torch.zeros_like(t) for t in local[key]]
        load_state_value(saved[key], target, layout)
        assert all(torch.equal(a, b) for a, b in zip(target, local[key])), f"load_state_value of {key}"
    return kinds


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_sharding_type_round_trips(world, tmp_path):
    kinds = run_world(_check_world, world, str(tmp_path / "ckpt"))
    assert all(k == kinds[0] for k in kinds)
    kinds = kinds[0]
    for table in TABLES:
        assert kinds[f"data_parallel.{table}.weight"] == "DTensor(Replicate)"
        assert kinds[f"table_wise.{table}.weight"] == "ShardedTensor"
        assert kinds[f"column_wise_multi.{table}.weight"] == "ShardedTensor"
        assert kinds[f"row_wise_skewed.{table}.weight"] == "ShardedTensor"
    assert kinds["row_wise.even.weight"] == "DTensor(Shard0)"
    assert kinds["row_wise.even.sum"] == "DTensor(Shard0)"
    assert kinds["column_wise.even.weight"] == "DTensor(Shard1)"
    assert kinds["column_wise.even.sum"] == "DTensor(Shard1)"  # one column per block
    if world != 2:
        assert kinds["row_wise.uneven.weight"] == "ShardedTensor"


def _save(path):
    rank = dist.get_rank()
    states = _all_states(dist.get_world_size())
    dcp.save(
        {
            key: to_state_value(_slice_local(full, layout, rank), layout)
            for key, (full, layout) in states.items()
        },
        checkpoint_id=path,
    )


def _load_resharded(path, saved_shapes):
    """Load a checkpoint saved at another world size; return the keys whose shape changed."""
    rank = dist.get_rank()
    states = _all_states(dist.get_world_size())
    changed = sorted(key for key, (_, layout) in states.items() if saved_shapes[key] != layout.global_shape)
    fresh = {
        key: [torch.zeros_like(t) for t in _slice_local(full, layout, rank)]
        for key, (full, layout) in states.items()
    }
    dcp.load(
        {
            key: to_state_value(fresh[key], layout)
            for key, (_, layout) in states.items()
            if key not in changed
        },
        checkpoint_id=path,
    )
    for key, (full, layout) in states.items():
        if key not in changed:
            expected = _slice_local(full, layout, rank)
            assert all(torch.equal(a, b) for a, b in zip(fresh[key], expected)), f"resharded load of {key}"
    # a state whose global shape differs cannot be resharded: dcp refuses it on every rank
    key = changed[0]
    with pytest.raises(CheckpointException) as failure:
        dcp.load({key: to_state_value(fresh[key], states[key][1])}, checkpoint_id=path)
    assert all("Size mismatch" in str(err) for err in failure.value.failures.values())
    return changed


def test_checkpoint_from_two_ranks_loads_on_four(tmp_path):
    path = str(tmp_path / "ckpt")
    run_world(_save, 2, path)
    saved_shapes = {key: layout.global_shape for key, (_, layout) in _all_states(2).items()}
    changed = run_world(_load_resharded, 4, path, saved_shapes)[0]
    # only per-row state of column-wise tables: one column per block, and the block count follows the world
    assert changed == sorted(
        f"{kind}.{table}.sum" for kind in ("column_wise", "column_wise_multi") for table in TABLES
    )


# ---------------------------------------------------------------------------------------------------
# layouts and errors (one process, except the cross-rank error)


def test_row_state_layout_of_row_and_column_splits():
    rw = build_parameter_sharding("row_wise", (10, 4), [0, 1, 2])
    layout = row_state_layout("t", rw, (10, 4), 3)
    assert layout.global_shape == (10,) and not layout.per_block
    assert [(s.shard_offsets, s.shard_sizes, s.rank) for s in layout.shards] == [
        ([0], [4], 0),
        ([4], [3], 1),
        ([7], [3], 2),
    ]
    cw = build_parameter_sharding("column_wise", (10, 7), [2, 0, 2], sizes=[3, 2, 2])
    layout = row_state_layout("t", cw, (10, 7), 3)
    assert layout.global_shape == (10, 3) and layout.per_block
    assert [(s.shard_offsets, s.rank) for s in layout.shards] == [([0, 0], 2), ([0, 1], 0), ([0, 2], 2)]
    assert [layout.local_shape(s) for s in layout.local_metadata(2)] == [(10,), (10,)]
    dp = row_state_layout(
        "t", build_parameter_sharding("data_parallel", (10, 4), [], world_size=2), (10, 4), 2
    )
    assert dp.replicated and dp.global_shape == (10,) and len(dp.shards) == 2


def test_dtensor_shard_dim_only_for_dtensor_own_splits():
    def layout(kind, shape, ranks, sizes=None):
        return table_layout("t", build_parameter_sharding(kind, shape, ranks, sizes=sizes), shape, 4)

    assert dtensor_shard_dim(layout("row_wise", (12, 4), [0, 1, 2]), 3) == 0
    assert dtensor_shard_dim(layout("column_wise", (4, 9), [0, 1, 2]), 3) == 1
    assert dtensor_shard_dim(layout("row_wise", (7, 4), [0, 1, 2], [3, 3, 1]), 3) == 0  # torch.chunk sizes
    assert dtensor_shard_dim(layout("row_wise", (7, 4), [0, 1, 2]), 3) is None  # array_split [3, 2, 2]
    assert dtensor_shard_dim(layout("row_wise", (12, 4), [1, 0, 2]), 3) is None  # out of rank order
    assert dtensor_shard_dim(layout("row_wise", (12, 4), [0, 1, 2]), 4) is None  # not every rank
    assert dtensor_shard_dim(layout("table_wise", (12, 4), [0]), 1) == 0
    assert dtensor_shard_dim(layout("row_wise", (2, 4), [0, 1, 2, 3]), 4) == 0  # empty tail shards


def test_local_shard_and_full_table_errors_name_the_table_and_sizes():
    sharding = build_parameter_sharding("column_wise", (6, 5), [1, 0, 1])
    layout = table_layout("user", sharding, (6, 5), 2)
    with pytest.raises(
        ValueError, match=r"table 'user': rank 1 holds 2 shard\(s\) of shapes \[\(6, 2\), \(6, 1\)\]"
    ):
        load_full_table(torch.zeros(6, 5), [torch.zeros(6, 2)], layout, rank=1)
    with pytest.raises(
        ValueError, match=r"table 'user': local shard 1 on rank 1 should have shape \[6, 1\], got \[1, 6\]"
    ):
        load_full_table(torch.zeros(6, 5), [torch.zeros(6, 2), torch.zeros(1, 6)], layout, rank=1)
    with pytest.raises(
        ValueError, match=r"table 'user': the full tensor has shape \[5, 6\], the table's is \[6, 5\]"
    ):
        load_full_table(torch.zeros(5, 6), [torch.zeros(6, 2), torch.zeros(6, 1)], layout, rank=1)
    with pytest.raises(ValueError, match="parameter 'user'.*ranks \\[3\\] are outside a world of 2"):
        table_layout("user", build_parameter_sharding("table_wise", (6, 5), [3]), (6, 5), 2)
    with pytest.raises(RuntimeError, match="initialized"):
        to_state_value([torch.zeros(6, 2)], layout)


def test_load_full_table_converts_dtype_and_fills_every_local_shard():
    sharding = build_parameter_sharding("column_wise", (6, 5), [1, 0, 1])
    layout = table_layout("user", sharding, (6, 5), 2)
    full = torch.arange(30, dtype=torch.float64).reshape(6, 5)
    local = [torch.zeros(6, 2, dtype=torch.float32), torch.zeros(6, 1, dtype=torch.float32)]
    load_full_table(full, local, layout, rank=1)
    assert torch.equal(local[0], full[:, 0:2].float()) and torch.equal(local[1], full[:, 4:5].float())


def _wrong_inputs():
    rank = dist.get_rank()
    layout = table_layout("item", build_parameter_sharding("row_wise", (5, 3), [0, 1]), (5, 3), 2)
    with pytest.raises(ValueError) as failure:
        full_table([torch.zeros(3, 3)], layout)  # rank 1 holds 2 rows, not 3
    full = _full((5, 3), 0)
    local = _slice_local(full, layout, rank)
    value = to_state_value(local, layout)
    skewed = table_layout("item", _skewed_rows("item", (5, 3), 1, 2, "cpu"), (5, 3), 2)
    target = [torch.zeros(layout.local_shape(md)) for md in skewed.local_metadata(rank)]
    if rank == 1:  # rank 0 holds only an empty shard: nothing to find
        with pytest.raises(
            ValueError, match=r"table 'item': the state value on rank 1 does not cover the piece at offsets"
        ):
            load_state_value(value, target, skewed)
    load_state_value(full, target, skewed)  # a plain tensor is the whole table
    assert all(torch.equal(t, e) for t, e in zip(target, _slice_local(full, skewed, rank)))
    return str(failure.value)


def test_errors_across_ranks():
    messages = run_world(_wrong_inputs, 2)
    assert messages[0] == messages[1]  # the same error on every rank, not a hang
    assert "rank 1: table 'item': local shard 0 on rank 1 should have shape [2, 3], got [3, 3]" in messages[0]
