"""Layer 4: DistributedModelParallel, the entry point of model parallelism.

``DistributedModelParallel(model)`` shards the modules a plan names (planning when given no plan),
wraps the rest for data parallelism and initializes what is still on the meta device; its
``fused_optimizer`` combines with the dense optimizer in a ``CombinedOptimizer``. See
docs/model_parallel.md.
"""

from shardkit.model_parallel.copying import sharded_model_copy
from shardkit.model_parallel.data_parallel import (
    DataParallelWrapper,
    DefaultDataParallelWrapper,
    model_parallel_state_names,
)
from shardkit.model_parallel.model_parallel import DistributedModelParallel, get_module, get_unwrapped_module
from shardkit.model_parallel.optimizers import CombinedOptimizer

__all__ = [
    "CombinedOptimizer",
    "DataParallelWrapper",
    "DefaultDataParallelWrapper",
    "DistributedModelParallel",
    "get_module",
    "get_unwrapped_module",
    "model_parallel_state_names",
    "sharded_model_copy",
]
