"""torchrec's ``ComputeKJTToJTDict`` / ``ComputeJTDictToKJT``: the KJT <-> dict conversions as modules
(so that they can sit in an ``nn.Module`` graph)."""

from __future__ import annotations

from typing import Dict

from torch import nn

from shardkit.sparse.jagged_tensor import JaggedTensor
from shardkit.sparse.keyed_jagged_tensor import KeyedJaggedTensor


class ComputeKJTToJTDict(nn.Module):
    """forward(kjt) -> ``{key: JaggedTensor}``, as ``kjt.to_dict()`` (views, one host sync if uncached)."""

    def forward(self, keyed_jagged_tensor: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        return keyed_jagged_tensor.to_dict()


class ComputeJTDictToKJT(nn.Module):
    """forward(``{key: JaggedTensor}``) -> KeyedJaggedTensor, as ``KeyedJaggedTensor.from_jt_dict``."""

    def forward(self, jt_dict: Dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_jt_dict(jt_dict)
