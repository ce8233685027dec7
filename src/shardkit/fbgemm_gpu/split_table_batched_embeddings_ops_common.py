"""fbgemm's ``fbgemm_gpu.split_table_batched_embeddings_ops_common``: ``PoolingMode``,
``BoundsCheckMode`` and ``CacheAlgorithm``.

``CacheAlgorithm`` is shardkit's own (``shardkit.sharding.cache_params``, where ``CacheParams`` takes
it), read on first use; while that module does not exist the name is an ``ImportError`` that says so.
"""

from __future__ import annotations

import enum
import importlib


class PoolingMode(enum.IntEnum):
    """fbgemm's pooling of a table-batched lookup (torchrec's ``PoolingType`` SUM / MEAN / NONE)."""

    SUM = 0
    MEAN = 1
    NONE = 2

    def do_pooling(self) -> bool:
        return self is not PoolingMode.NONE


class BoundsCheckMode(enum.IntEnum):
    """fbgemm's reaction to an id outside its table. shardkit's lookups check ids themselves (an
    out-of-range id is an ``IndexError`` naming the feature and table; ``SHARDKIT_VALIDATE=0`` skips it),
    so a program's choice here changes nothing."""

    FATAL = 0
    WARNING = 1
    IGNORE = 2
    NONE = 3


_LAZY = {"CacheAlgorithm": "shardkit.sharding.cache_params"}


def __getattr__(name: str):
    if name in _LAZY:
        try:
            return getattr(importlib.import_module(_LAZY[name]), name)
        except (ImportError, AttributeError) as err:
            raise ImportError(
                f"fbgemm_gpu's {name} stands for {_LAZY[name]}.{name}, which this shardkit does not "
                f"have yet ({err}); docs/names.md"
            ) from err
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
