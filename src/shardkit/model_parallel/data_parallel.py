"""Data parallelism for what the plan did not shard: the wrapper interface and the DDP default.

After sharding, a model holds two kinds of state: model-parallel state (the shards of the sharded
modules, each rank its own, with gradients already complete after the output dist's backward) and
replicated state (dense layers, data-parallel tables), whose gradients must be averaged over ranks.
The default wrapper wraps the model in torch's ``DistributedDataParallel`` and tells it to ignore the
model-parallel state, so DDP neither broadcasts nor all-reduces a shard. On CPU, with the shared-memory
exchange on (the default), its gradient all-reduce goes through shared memory (:func:`shm_allreduce_hook`),
a DDP comm hook that yields to the caller's: a hook the caller registers on that DDP replaces it
(:mod:`shardkit.model_parallel.comm_hook_slot`).
"""

from __future__ import annotations

import abc
import inspect
from typing import TYPE_CHECKING, Optional, Set

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from shardkit.distributed import shm_exchange
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.model_parallel.comm_hook_slot import YieldingDistributedDataParallel
from shardkit.sharding.types import ShardedModule

if TYPE_CHECKING:
    from shardkit.model_parallel.model_parallel import DistributedModelParallel

_COMM_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def model_parallel_state_names(module: nn.Module, prefix: str = "") -> Set[str]:
    """Fully qualified names of the parameters and buffers of ``module`` that are model-parallel:
    the shards of every ``ShardedModule`` inside it (its ``sharded_parameter_names``: replicated
    tables are left out, DDP keeps them in sync) and all of its buffers (optimizer state)."""
    names: Set[str] = set()
    for path, sub in module.named_modules(prefix=prefix):
        if isinstance(sub, ShardedModule):
            names |= set(sub.sharded_parameter_names(path))
            names |= {n for n, _ in sub.named_buffers(path)}
    return names


def _device_index(device: torch.device) -> int:
    """The index of ``device`` (DDP needs one), the current CUDA device when it has none."""
    return device.index if device.index is not None else torch.cuda.current_device()


# DDP's forward_sync_buffers came in torch 2.13 (broadcast_buffers, deprecated there, before it)
_HAS_FORWARD_SYNC_BUFFERS = (
    "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
)


class ShmAllReduceState:
    """The state of :func:`shm_allreduce_hook`: the group's shared-memory exchange, and how many buckets
    went through it."""

    def __init__(self, exchange: shm_exchange.SharedMemoryExchange) -> None:
        self.exchange = exchange
        self.calls = 0

    def __deepcopy__(self, memo) -> ShmAllReduceState:
        return self  # a handle on the group's exchange (a copied DDP keeps its hooks' states, unused)

    def __getstate__(self) -> dict:
        return {"exchange": None, "calls": self.calls}  # mappings of this process do not travel


def shm_allreduce_hook(state, bucket):  # unannotated: DDP checks real annotations, these are strings
    """DDP's default all-reduce (each rank's gradients divided by the world size, then summed) through
    the shared-memory exchange instead of gloo; the sum is in rank order, the same bits on every rank."""
    tensor = bucket.buffer()
    tensor.div_(state.exchange.world)
    state.exchange.all_reduce_sum(tensor).wait()
    state.calls += 1
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


class DataParallelWrapper(abc.ABC):
    """Applies data parallelism to the modules of a ``DistributedModelParallel`` that are not sharded."""

    @abc.abstractmethod
    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        """Wrap ``dmp``'s module in place (replace ``dmp._dmp_wrapped_module``)."""


class DefaultDataParallelWrapper(DataParallelWrapper):
    """Wraps the model in ``DistributedDataParallel`` over ``env``'s group, ignoring the shards.

    Args:
        bucket_cap_mb, static_graph, find_unused_parameters: passed to DDP.
        allreduce_comm_precision: ``"fp16"`` or ``"bf16"`` compresses the gradient all-reduce
            (DDP comm hook); None keeps full precision.
        shm_allreduce: with the shared-memory exchange on (the default; ``SHARDKIT_SHM_EXCHANGE=0``
            turns it off), a CPU model on one host and no ``allreduce_comm_precision``, install
            :func:`shm_allreduce_hook` (the gradient all-reduce through shared memory, not gloo) as
            the DDP's default hook: a hook the caller registers on the DDP (``register_comm_hook``,
            ``_register_builtin_comm_hook``, ``_register_fused_optim``) replaces it. False leaves
            DDP's own all-reduce and its hook slot empty.

    The DDP is a :class:`~shardkit.model_parallel.comm_hook_slot.YieldingDistributedDataParallel`
    (a ``DistributedDataParallel``: only its hook registration differs, and only while the default
    hook is installed).

    Does nothing when the environment has no process group (a local world), when the module is
    already wrapped, or when no replicated parameter needs a gradient (DDP would have nothing to do).
    """

    def __init__(
        self,
        bucket_cap_mb: int = 25,
        static_graph: bool = True,
        find_unused_parameters: bool = False,
        allreduce_comm_precision: Optional[str] = None,
        shm_allreduce: bool = True,
    ) -> None:
        if allreduce_comm_precision is not None and allreduce_comm_precision not in _COMM_HOOKS:
            raise ValueError(
                f"allreduce_comm_precision must be one of {sorted(_COMM_HOOKS)} or None, "
                f"got {allreduce_comm_precision!r}"
            )
        self._bucket_cap_mb = bucket_cap_mb
        self._static_graph = static_graph
        self._find_unused_parameters = find_unused_parameters
        self._allreduce_comm_precision = allreduce_comm_precision
        self._shm_allreduce = shm_allreduce

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        module = dmp._dmp_wrapped_module
        if env.process_group is None or isinstance(module, DistributedDataParallel):
            return
        ignored = model_parallel_state_names(module)
        replicated = [p for n, p in module.named_parameters() if n not in ignored and p.requires_grad]
        if not replicated:
            return
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, sorted(ignored))
        if not _HAS_FORWARD_SYNC_BUFFERS:
            # torch < 2.13: broadcast_buffers=False also skips the init sync, so sync them here
            for name, buffer in module.named_buffers():
                if name not in ignored:
                    dist.broadcast(
                        buffer, src=dist.get_global_rank(env.process_group, 0), group=env.process_group
                    )
        ddp = YieldingDistributedDataParallel(
            module,
            device_ids=None if device.type == "cpu" else [_device_index(device)],
            process_group=env.process_group,
            # replicated buffers start equal (synced at init) and are not re-broadcast every forward
            **(
                {"forward_sync_buffers": False} if _HAS_FORWARD_SYNC_BUFFERS else {"broadcast_buffers": False}
            ),
            bucket_cap_mb=self._bucket_cap_mb,
            static_graph=self._static_graph,
            find_unused_parameters=self._find_unused_parameters,
            gradient_as_bucket_view=True,
        )
        if self._allreduce_comm_precision is not None:
            ddp.register_comm_hook(env.process_group, _COMM_HOOKS[self._allreduce_comm_precision])
        elif self._shm_allreduce and device.type == "cpu" and shm_exchange.shm_exchange_enabled():
            exchange = shm_exchange.exchange_for(env.process_group)  # a collective, on every rank here
            if exchange is not None:
                ddp.install_default_comm_hook(ShmAllReduceState(exchange), shm_allreduce_hook)
        dmp._dmp_wrapped_module = ddp


__all__ = [
    "DataParallelWrapper",
    "DefaultDataParallelWrapper",
    "ShmAllReduceState",
    "model_parallel_state_names",
    "shm_allreduce_hook",
]
