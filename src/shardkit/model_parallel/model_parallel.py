"""DistributedModelParallel: shard what a plan says, data-parallelize the rest, train as one model.

Construction, in order:

1. the plan: the one given, or ``EmbeddingShardingPlanner.collective_plan`` (rank 0 plans, every rank
   receives the same plan) over the sharders;
2. sharding: every submodule whose path the plan names and whose type a sharder handles is replaced
   by ``sharder.shard(module, module_plan, env, device)``;
3. ``init_parameters``: parameters and buffers still on the meta device are allocated on ``device``
   and their module's ``reset_parameters`` runs (the replicas then agree through step 4, which
   broadcasts rank 0's values);
4. ``init_data_parallel``: the ``DataParallelWrapper`` (default: DDP that ignores the shards) wraps
   the model.

The wrapped model lives in ``_dmp_wrapped_module`` (possibly a DDP around it); ``module`` is the bare
model, and ``state_dict`` / ``named_parameters`` use the bare model's names, so a checkpoint's keys do
not depend on the wrappers.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys
from torch.nn.parallel import DistributedDataParallel

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.distributed.topology import get_local_size
from shardkit.model_parallel.copying import shared_process_groups
from shardkit.model_parallel.data_parallel import DataParallelWrapper, DefaultDataParallelWrapper
from shardkit.model_parallel.optimizers import CombinedOptimizer
from shardkit.planner import EmbeddingShardingPlanner, Topology
from shardkit.sharding.default_sharders import get_default_sharders
from shardkit.sharding.types import ModuleSharder, ShardedModule, ShardingPlan
from shardkit.sharding.utils import append_prefix, copy_to_device, init_parameters


def get_module(module: nn.Module) -> nn.Module:
    """``module`` without its ``DistributedModelParallel`` wrappers (a DDP inside stays)."""
    while isinstance(module, DistributedModelParallel):
        module = module._dmp_wrapped_module
    return module


def get_unwrapped_module(module: nn.Module) -> nn.Module:
    """``module`` without its ``DistributedModelParallel`` and ``DistributedDataParallel`` wrappers."""
    while True:
        if isinstance(module, DistributedModelParallel):
            module = module._dmp_wrapped_module
        elif isinstance(module, DistributedDataParallel):
            module = module.module
        else:
            return module


class DistributedModelParallel(nn.Module):
    """The entry point of model parallelism: a model whose shardable modules are sharded by a plan.

    Args:
        module: the model (its shardable submodules may be on the meta device).
        env: the world (default: the default process group's).
        device: the compute device (default CPU).
        plan: the sharding plan (default: ``EmbeddingShardingPlanner(...).collective_plan``).
        sharders: the sharders to use (default: ``EmbeddingBagCollectionSharder()`` and the
            managed-collision EBC / EC sharders).
        init_data_parallel: wrap the unsharded part for data parallelism now; pass False to
            postpone it (lazy modules), run a forward, then call :meth:`init_data_parallel`.
        init_parameters: allocate and initialize the parameters still on the meta device.
        data_parallel_wrapper: how to wrap the unsharded part (default ``DefaultDataParallelWrapper()``).

    ``forward(*args, **kwargs)`` is the model's forward. Every rank must construct it with the same
    model and plan and call forward / backward the same number of times (sharded modules communicate).
    """

    def __init__(
        self,
        module: nn.Module,
        env: Optional[ShardingEnv] = None,
        device: Optional[torch.device] = None,
        plan: Optional[ShardingPlan] = None,
        sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
        init_data_parallel: bool = True,
        init_parameters: bool = True,
        data_parallel_wrapper: Optional[DataParallelWrapper] = None,
    ) -> None:
        super().__init__()
        self._env = env if env is not None else ShardingEnv.from_process_group(dist.GroupMember.WORLD)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._sharders = list(sharders) if sharders is not None else get_default_sharders()
        self._sharder_map: Dict[type, ModuleSharder[nn.Module]] = {s.module_type: s for s in self._sharders}
        self._data_parallel_wrapper = data_parallel_wrapper or DefaultDataParallelWrapper()
        self._plan = plan if plan is not None else self._make_plan(module)
        self._dmp_wrapped_module: nn.Module = self._shard_modules(module, "")
        if init_parameters:
            self._init_parameters(self._dmp_wrapped_module)
        if init_data_parallel:
            self.init_data_parallel()

    # ---- construction -------------------------------------------------------------------------

    def _make_plan(self, module: nn.Module) -> ShardingPlan:
        world = self._env.world_size
        topology = Topology(
            world_size=world, compute_device=self.device.type, local_world_size=get_local_size(world)
        )
        planner = EmbeddingShardingPlanner(topology=topology)
        if self._env.process_group is None:
            return planner.plan(module, self._sharders)
        return planner.collective_plan(module, self._sharders, self._env.process_group)

    def _shard_modules(self, module: nn.Module, path: str) -> nn.Module:
        """``module`` with the planned submodules replaced by their sharded versions (in place)."""
        sharder = self._sharder_map.get(type(module))
        module_plan = self._plan.get_plan_for_module(path)
        if sharder is not None and module_plan is not None:
            return sharder.shard(module, module_plan, self._env, self.device)
        for name, child in list(module.named_children()):
            sharded = self._shard_modules(child, append_prefix(path, name))
            if sharded is not child:
                setattr(module, name, sharded)
        return module

    def _init_parameters(self, module: nn.Module) -> None:
        """Allocate on ``device`` the tensors still on meta, then let their module initialize them."""
        init_parameters(module, self.device)

    def init_data_parallel(self) -> None:
        """Wrap the unsharded part for data parallelism (see the constructor); calling it again is a no-op."""
        self._data_parallel_wrapper.wrap(self, self._env, self.device)

    # ---- access -------------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The bare model: sharded modules in place, no DDP / DMP wrapper around it."""
        return get_unwrapped_module(self)

    @property
    def plan(self) -> ShardingPlan:
        return self._plan

    @property
    def fused_optimizer(self) -> CombinedOptimizer:
        """The fused optimizers of the sharded modules, keyed by module path (``""`` for the root).

        They update the tables inside backward; ``step`` / ``zero_grad`` do nothing. Combine with the
        dense optimizer: ``CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)])``.
        """
        found: List[Tuple[str, Any]] = []
        for path, sub in self.module.named_modules():
            if isinstance(sub, ShardedModule):
                try:
                    found.append((path, sub.fused_optimizer))
                except (AttributeError, ValueError):
                    continue  # no fused-kernel shard on this rank (or a module without fused kernels)
        return CombinedOptimizer(found)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._dmp_wrapped_module(*args, **kwargs)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, nn.Parameter]]:
        """Parameters under the bare model's names (no ``_dmp_wrapped_module.module.`` prefix)."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def bare_named_parameters(
        self, prefix: str = "", recurse: bool = True
    ) -> Iterator[Tuple[str, nn.Parameter]]:
        """Every parameter once, under the bare model's names; what a dense optimizer is built from
        (the fused tables' weights never get a ``.grad``, so torch optimizers leave them alone)."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate=True)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, torch.Tensor]]:
        """Buffers under the bare model's names."""
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(
        self, destination: Optional[Dict[str, Any]] = None, prefix: str = "", keep_vars: bool = False
    ) -> Dict[str, Any]:
        """The bare model's state dict (keys do not depend on the wrappers); sharded modules contribute
        whatever their own ``state_dict`` holds (this rank's shards)."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(
        self, state_dict: Dict[str, Any], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """Load a :meth:`state_dict` (bare-model keys) into the model."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def copy(self, device: torch.device) -> DistributedModelParallel:
        """A copy of this model with the tensors on ``self.device`` moved to ``device``.

        Submodules that are a ``CopyableMixin`` copy themselves; the copy shares the process group.
        """
        with shared_process_groups():
            copied = copy_to_device(self, self.device, torch.device(device))
        copied.device = torch.device(device)
        return copied


__all__ = ["DistributedModelParallel", "get_module", "get_unwrapped_module"]
