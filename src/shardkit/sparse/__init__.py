"""Jagged feature batches: JaggedTensor, KeyedJaggedTensor, KeyedTensor (pure tensor code, layer L0).

See docs/sparse.md for the layouts, which methods synchronize with the device and the ``validate``
switch.
"""

from shardkit.sparse.jagged_tensor import JaggedTensor
from shardkit.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from shardkit.sparse.keyed_tensor import KeyedTensor

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor"]
