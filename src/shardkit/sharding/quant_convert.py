"""A trained sharded EmbeddingBagCollection converted, shard by shard, into a sharded quantized one.

The path from a training checkpoint to serving at another world size (docs/quant.md):

1. at the serving world size, build the float module (on ``meta``), shard it with the serving plan and
   load the checkpoint into it (``shardkit.checkpoint.load`` or ``dcp.load``): each rank reads only its
   own shards, whatever the world size and plan of the training run (DCP reshards);
2. :func:`quantize_sharded`: each rank quantizes its own shards. A row block holds whole rows; the
   column blocks of one table agree on each row's range with one all-reduce of its minimum and maximum
   (8 bytes a row), so that every block stores the codes, scale and bias the whole row would get.

No rank ever holds more of a table than its own shards (plus that per-row range for column blocks),
and the result equals quantizing the unsharded model (``QuantEmbeddingBagCollection.from_float``),
then sharding it.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Union

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import gather_objects
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.kernels.quant_rows import INT_BITS
from shardkit.modules import DataType
from shardkit.quant import QuantEmbeddingBagCollection, quantize_into, storage_of
from shardkit.sharding.embeddingbag import ShardedEmbeddingBagCollection
from shardkit.sharding.quant_embeddingbag import ShardedQuantEmbeddingBagCollection
from shardkit.sharding.types import EmbeddingComputeKernel, EmbeddingModuleShardingPlan, ShardingType

_COLUMN_SPLIT = (ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value)


def _row_ranges(module: ShardedEmbeddingBagCollection, table, shards, env: ShardingEnv):
    """fp32 ``[rows]`` minimum and maximum of each row of ``table`` over all its column blocks (a
    collective over ``env``'s group: every rank calls it for the same tables in the same order)."""
    rows = table.config.num_embeddings
    device = next(iter(shards.values())).device if shards else torch.device("cpu")
    low = torch.full((rows,), float("inf"), device=device)
    high = torch.full((rows,), float("-inf"), device=device)
    for (_, r0, r1, _, _), values in shards.items():
        low[r0:r1] = torch.minimum(low[r0:r1], values.amin(dim=1).float())
        high[r0:r1] = torch.maximum(high[r0:r1], values.amax(dim=1).float())
    if env.world_size > 1:
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=env.process_group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=env.process_group)
    return low, high


@torch.no_grad()
def quantize_sharded(
    module: ShardedEmbeddingBagCollection,
    plan: EmbeddingModuleShardingPlan,
    env: ShardingEnv,
    data_type: Optional[Union[DataType, Dict[str, DataType]]] = None,
    output_dtype: torch.dtype = torch.float32,
) -> ShardedQuantEmbeddingBagCollection:
    """The sharded quantized twin of ``module`` (a collective; ``module`` is not modified).

    Args:
        module: a float ``ShardedEmbeddingBagCollection`` holding the trained values (e.g. just loaded
            from a checkpoint).
        plan: the plan ``module`` was sharded with (table-wise, row-wise, column-wise tables); the
            quantized module uses it with the ``quant`` kernel.
        env: the world of ``module``.
        data_type: every table's storage, or ``{table: DataType}``; None (or a table missing from the
            dict): the table config's ``data_type``.
        output_dtype: the quantized module's output dtype.

    Raises ``ValueError`` on every rank if any rank's shards cannot be stored (a value that is not
    finite or beyond fp16's range in an int table).
    """
    if not isinstance(module, ShardedEmbeddingBagCollection) or isinstance(
        module, ShardedQuantEmbeddingBagCollection
    ):
        raise TypeError(
            f"quantize_sharded takes a float ShardedEmbeddingBagCollection, got {type(module).__name__}"
        )

    def chosen(config) -> DataType:
        if isinstance(data_type, dict):
            return data_type.get(config.name, config.data_type)
        return config.data_type if data_type is None else data_type

    configs = [dataclasses.replace(t.config, data_type=chosen(t.config)) for t in module._tables]
    quant_plan = type(plan)()
    for name, sharding in plan.items():
        quant_plan[name] = dataclasses.replace(sharding, compute_kernel=EmbeddingComputeKernel.QUANT.value)
    template = QuantEmbeddingBagCollection(
        configs, is_weighted=module._weighted, device=torch.device("meta"), output_dtype=output_dtype
    )
    quantized = ShardedQuantEmbeddingBagCollection(template, quant_plan, env, device=torch.device("meta"))
    float_shards = module.local_shards()
    device = next(iter(float_shards.values())).device if float_shards else torch.device("cpu")
    quantized.lookups.to_empty(device=device)
    stored = quantized.local_shards()
    storages = {c.name: storage_of(c.data_type) for c in configs}
    error = None
    if set(stored) != set(float_shards):
        error = f"the plan's shards on this rank {sorted(stored)} are not the module's {sorted(float_shards)}"
    for table in module._tables:  # declaration order: the same collectives on every rank
        mine = {key: values for key, values in float_shards.items() if key[0] == table.name}
        ranges = None
        if table.sharding_type in _COLUMN_SPLIT and storages[table.name] in INT_BITS:
            ranges = _row_ranges(module, table, mine, env)
        for (name, r0, r1, c0, c1), values in mine.items():
            low, high = (None, None) if ranges is None else (ranges[0][r0:r1], ranges[1][r0:r1])
            if (name, r0, r1, c0, c1) not in stored:
                continue  # reported above
            try:
                quantize_into(stored[(name, r0, r1, c0, c1)], values, storages[name], low, high)
            except ValueError as err:
                error = error or f"table {name!r} rows [{r0}, {r1}) columns [{c0}, {c1}): {err}"
    problems = [f"rank {r}: {e}" for r, e in enumerate(gather_objects(error, env.process_group)) if e]
    if problems:
        raise ValueError("cannot quantize the sharded tables: " + "; ".join(problems))
    return quantized


__all__ = ["quantize_sharded"]
