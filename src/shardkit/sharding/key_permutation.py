"""A sharding's fixed permutation of its input KJT's keys, by the native segment kernel where it can run.

``KeyedJaggedTensor.permute`` cuts the values and the lengths into one view per key and
concatenates them in the new order (two splits into ``K`` views and two concatenations). A
table-wise sharding permutes every batch by the same permutation of all its keys before the KJT
all-to-all; with one batch size for every key, each key's lengths are ``B`` consecutive rows and its
values one contiguous range, so the native ``permute_segments`` kernel moves the values (and
weights) with one memcpy per key, and the lengths are one ``index_select`` over their ``[K, B]``
view. Same tensors as ``permute``, bitwise.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from shardkit.kernels import native_for
from shardkit.sparse import KeyedJaggedTensor


class KeyPermutation:
    """``apply(kjt)`` = ``kjt.permute(indices)`` (``indices``: fixed per plan).

    The native path runs for a permutation of all of the KJT's keys, one batch size (no variable
    batch, no inverse indices), values holding no tail beyond the keys, weights that need no
    gradient (the kernel is not differentiable) and the native kernels available (CPU); anything
    else goes through ``permute``. Its index tensors are built once per (device, batch size).
    """

    def __init__(self, indices: List[int]) -> None:
        self.indices = [int(i) for i in indices]
        self._permutation = sorted(self.indices) == list(range(len(self.indices)))
        self._index: Dict[Tuple[torch.device, int], Tuple[torch.Tensor, torch.Tensor]] = {}

    def apply(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        values, weights = kjt.values(), kjt.weights_or_none()
        native = native_for(values.device) if self._permutation else None
        if (
            native is None
            or len(kjt.keys()) != len(self.indices)
            or kjt.variable_stride_per_key()
            or kjt.inverse_indices_or_none() is not None
            or values.dim() != 1
            or (weights is not None and weights.requires_grad and torch.is_grad_enabled())
        ):
            return kjt.permute(self.indices)
        per_key = kjt.length_per_key()
        if sum(per_key) != values.size(0):  # values past the last key: permute drops them
            return kjt.permute(self.indices)
        batch, keys = kjt.stride(), kjt.keys()
        rows, order = self._tensors(values.device, batch)
        lengths = kjt.lengths().contiguous()
        out_values, out_weights = native.permute_segments(
            lengths, values.contiguous(), None if weights is None else weights.contiguous(), rows, order
        )
        # the checks skipped: the input KJT passed them, and these are its tensors reordered
        return KeyedJaggedTensor._trusted(
            [keys[i] for i in self.indices],
            out_values,
            out_weights,
            lengths.view(len(keys), batch).index_select(0, order).view(-1),
            batch,
            [per_key[i] for i in self.indices],
        )

    def _tensors(self, device: torch.device, batch: int) -> Tuple[torch.Tensor, torch.Tensor]:
        key = (device, batch)
        if key not in self._index:
            rows = torch.full((len(self.indices),), batch, dtype=torch.int64, device=device)
            self._index[key] = (rows, torch.tensor(self.indices, dtype=torch.int64, device=device))
        return self._index[key]


__all__ = ["KeyPermutation"]
