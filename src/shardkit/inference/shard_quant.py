"""A quantized model sharded for inference (torchrec.inference.modules' ``shard_quant_model``).

torchrec shards a quantized model over ``world_size`` devices of one process; shardkit's sharded modules
are collectives over a process group, so here every rank of a world of ``world_size`` processes calls
``shard_quant_model`` with the same quantized model, and each gets its shards (docs/serving.md). The plan
is the planner's (``EmbeddingShardingPlanner`` with the tables' stored sizes, ``constraints`` and the
memory caps), made on rank 0 and sent to the others, or the one passed.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.distributed.topology import get_local_size
from shardkit.model_parallel import DistributedModelParallel
from shardkit.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from shardkit.quant import (
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    QuantFeatureProcessedEmbeddingBagCollection,
)
from shardkit.sharding.quant_embeddingbag import (
    QuantEmbeddingBagCollectionSharder,
    QuantFeatureProcessedEmbeddingBagCollectionSharder,
)
from shardkit.sharding.types import ModuleSharder, ShardingPlan

_QUANT_MODULES = (
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    QuantFeatureProcessedEmbeddingBagCollection,
)


def _inside(path: str, model: nn.Module, handled: set) -> bool:
    """Whether a module of a ``handled`` type encloses the module at ``path`` (it is sharded with it)."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if type(model.get_submodule(".".join(parts[:i]))) in handled:
            return True
    return False


def default_quant_sharders() -> List[ModuleSharder[nn.Module]]:
    """The sharders of shardkit's quantized collections (pooled: the bag and feature-processed ones)."""
    return [QuantEmbeddingBagCollectionSharder(), QuantFeatureProcessedEmbeddingBagCollectionSharder()]


def shard_quant_model(
    model: nn.Module,
    world_size: int = 1,
    compute_device: str = "cpu",
    sharding_device: Optional[str] = None,
    sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
    device_memory_size: Optional[int] = None,
    constraints: Optional[Dict[str, ParameterConstraints]] = None,
    ddr_cap: Optional[int] = None,
    plan: Optional[ShardingPlan] = None,
) -> Tuple[nn.Module, ShardingPlan]:
    """``model`` (modified in place) with its quantized collections replaced by sharded ones, and the plan.

    Args:
        model: a quantized model (``quantize_inference_model``), the same on every rank.
        world_size: the number of ranks; must be the default process group's size (1 without one).
        compute_device: ``"cpu"`` or ``"cuda"``: where the shards live and the lookups run.
        sharding_device: torchrec shards on ``"meta"`` and loads weights later; shardkit's shards copy
            the quantized rows out of ``model``, so only None or ``compute_device`` is accepted.
        sharders: default :func:`default_quant_sharders`.
        device_memory_size: the device memory per rank for the planner (``Topology.hbm_cap``).
        constraints: table name -> ``ParameterConstraints`` (sharding types, ranks, ...).
        ddr_cap: host memory per rank (``Topology.ddr_cap``).
        plan: a plan to use instead of the planner's (shardkit's addition).

    Returns ``(model, plan)``: the sharded modules take this rank's requests and return this rank's
    answers; every rank must call forward the same number of times. ``ValueError`` for a world size that
    is not the process group's, an unsupported ``sharding_device``, or a quantized module no sharder
    handles (a ``QuantEmbeddingCollection``: it would silently stay whole on every rank).
    """
    actual = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world_size != actual:
        raise ValueError(
            f"shard_quant_model: world_size {world_size}, but this process group has {actual} rank(s); "
            "shardkit shards over processes: launch world_size ranks (./dev launch -n N) and call it on each"
        )
    if sharding_device not in (None, compute_device):
        raise ValueError(
            f"shard_quant_model: sharding_device {sharding_device!r} is not supported: the shards copy "
            f"the quantized rows out of the model, on compute_device {compute_device!r} (pass None)"
        )
    device = torch.device(compute_device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sharders = default_quant_sharders() if sharders is None else list(sharders)
    handled = {s.module_type for s in sharders}
    unshardable = [
        f"{path or 'the model'} ({type(m).__name__})"
        for path, m in model.named_modules()
        if isinstance(m, _QUANT_MODULES) and type(m) not in handled and not _inside(path, model, handled)
    ]
    if unshardable:
        raise ValueError(
            f"shard_quant_model: no sharder for {unshardable}: they would stay whole on every rank. shardkit "
            "shards QuantEmbeddingBagCollection and QuantFeatureProcessedEmbeddingBagCollection (no sharded "
            "QuantEmbeddingCollection yet); keep such a module out of the model given here"
        )
    if actual > 1 or (dist.is_available() and dist.is_initialized()):
        env = ShardingEnv.from_process_group(None)
    else:
        env = ShardingEnv.from_local(1, 0)
    if plan is None:
        topology = Topology(
            world_size=world_size,
            compute_device=device.type,
            local_world_size=get_local_size(world_size),
            hbm_cap=device_memory_size,
            ddr_cap=ddr_cap,
        )
        planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
        plan = (
            planner.plan(model, sharders)
            if env.process_group is None
            else planner.collective_plan(model, sharders, env.process_group)
        )
    sharded = DistributedModelParallel(
        model, env=env, device=device, plan=plan, sharders=sharders, init_data_parallel=False
    )
    return sharded.module, plan


__all__ = ["default_quant_sharders", "shard_quant_model"]
