"""Jagged feature batches: JaggedTensor, KeyedJaggedTensor, KeyedTensor (pure tensor code, layer L0).

See docs/sparse.md for the layouts, which methods synchronize with the device, the ``validate``
switch and the rule for which inputs are accepted. Importing the package registers the three types
with ``torch.utils._pytree``.
"""

from shardkit.sparse import pytree as _pytree  # noqa: F401 - registers the types with torch's pytree
from shardkit.sparse.comparison import jt_is_equal, kjt_is_equal
from shardkit.sparse.conversion_modules import ComputeJTDictToKJT, ComputeKJTToJTDict
from shardkit.sparse.jagged_tensor import JaggedTensor
from shardkit.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from shardkit.sparse.keyed_tensor import KeyedTensor, permute_multi_embedding, regroup_kts

__all__ = [
    "ComputeJTDictToKJT",
    "ComputeKJTToJTDict",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "jt_is_equal",
    "kjt_is_equal",
    "permute_multi_embedding",
    "regroup_kts",
]
