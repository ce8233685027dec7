"""shardkit: model-parallel building blocks for PyTorch.

The top level exports torchrec's top-level names (``shardkit.EmbeddingBagCollection`` as
``torchrec.EmbeddingBagCollection``) and its subpackages as attributes (``shardkit.optim.RowWiseAdagrad``
after a bare ``import shardkit``, as ``torchrec.optim.RowWiseAdagrad`` after ``import torchrec``), each
imported on first use so that ``import shardkit`` stays light.
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "DataType": "shardkit.modules",
    "EmbeddingBagConfig": "shardkit.modules",
    "EmbeddingConfig": "shardkit.modules",
    "PoolingType": "shardkit.modules",
    "EmbeddingBagCollection": "shardkit.modules",
    "EmbeddingCollection": "shardkit.modules",
    "JaggedTensor": "shardkit.sparse",
    "KeyedJaggedTensor": "shardkit.sparse",
    "KeyedTensor": "shardkit.sparse",
    "DistributedModelParallel": "shardkit.model_parallel",
}

# Subpackages reachable as attributes of the bare package (torchrec's __init__ imports its own).
_SUBPACKAGES = frozenset(
    {
        "datasets",
        "distributed",
        "model_parallel",
        "models",
        "modules",
        "optim",
        "planner",
        "quant",
        "sharding",
        "sparse",
    }
)

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBPACKAGES:
        return importlib.import_module(f"shardkit.{name}")
    raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
