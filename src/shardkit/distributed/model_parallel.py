"""torchrec's ``torchrec.distributed.model_parallel`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.model_parallel.data_parallel import DataParallelWrapper, DefaultDataParallelWrapper
from shardkit.model_parallel.model_parallel import DistributedModelParallel, get_module, get_unwrapped_module

__all__ = [
    "DataParallelWrapper",
    "DefaultDataParallelWrapper",
    "DistributedModelParallel",
    "get_module",
    "get_unwrapped_module",
]
