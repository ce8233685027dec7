"""torchrec's ``KTRegroupAsDict`` (``torchrec.modules.regroup``): a module that regroups the pooled
embeddings of several KeyedTensors into named groups, e.g. the user and item towers of a two-tower
model fed by one or more embedding collections.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from shardkit.modules.embedding_configs import DataType, data_type_to_dtype
from shardkit.sparse import KeyedTensor


class KTRegroupAsDict(nn.Module):
    """``forward(keyed_tensors) -> {keys[i]: tensor of groups[i]}``.

    Args:
        groups: for each output, the keys whose slices it concatenates (along the KeyedTensors'
            ``key_dim``), in order; a key may appear in several groups or in none.
        keys: the name of each group's output (as many as groups, distinct).
        emb_dtype: if given, the outputs are cast to this ``DataType``'s dtype (e.g. ``DataType.BF16``).

    Each output is ``[B, sum of the group's widths]`` for KeyedTensors of ``key_dim`` 1; keys are looked
    up across all inputs (first occurrence wins). Traceable by ``torch.fx`` (the regroup is one call).
    """

    def __init__(
        self, groups: List[List[str]], keys: List[str], emb_dtype: Optional[DataType] = None
    ) -> None:
        super().__init__()
        if len(groups) != len(keys):
            raise ValueError(
                f"KTRegroupAsDict: {len(groups)} groups but {len(keys)} keys (one key per group)"
            )
        if len(set(keys)) != len(keys):
            raise ValueError(f"KTRegroupAsDict: repeated output keys in {keys}")
        self._groups = [list(g) for g in groups]
        self._keys = list(keys)
        self._dtype: Optional[torch.dtype] = None if emb_dtype is None else data_type_to_dtype(emb_dtype)

    def forward(self, keyed_tensors: List[KeyedTensor]) -> Dict[str, torch.Tensor]:
        out = KeyedTensor.regroup_as_dict(keyed_tensors, self._groups, self._keys)
        if self._dtype is not None:
            out = {key: tensor.to(self._dtype) for key, tensor in out.items()}
        return out
