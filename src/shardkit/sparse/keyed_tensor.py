"""KeyedTensor: several dense per-key tensors side by side in one tensor (e.g. pooled embeddings).

``values`` is ``[B, sum(length_per_key)]`` for the default ``key_dim=1``: key k occupies the slice
``offset_per_key[k] : offset_per_key[k + 1]`` of that dimension. Everything here is metadata on the
host, so no method synchronizes with the device, and every result is a view or one concatenation
(autograd flows through all of them).

``regroup`` (and ``regroup_kts`` / ``permute_multi_embedding`` / ``regroup_as_dict``, which use it) is
one leaf call under ``torch.fx`` symbolic tracing (``torch.fx.wrap``), as torchrec's, so a model that
regroups traced KeyedTensors traces.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx

from shardkit.sparse.printing import keyed_tensor_string

_OWNER = "KeyedTensor"


def unknown_key_error(owner: str, key: str, known: Sequence[str]) -> KeyError:
    return KeyError(f"{owner}: unknown key {key!r}; known keys: {list(known)}")


class KeyedTensor:
    """Dense per-key tensors concatenated along ``key_dim``.

    Args:
        keys: K names; a repeated key resolves to its first occurrence.
        length_per_key: K non-negative widths (e.g. embedding dims) summing to ``values.size(key_dim)``.
        values: e.g. ``[B, sum(length_per_key)]`` (any dtype).
        key_dim: the dimension the keys are laid out along.
    """

    def __init__(
        self,
        keys: List[str],
        length_per_key: List[int],
        values: torch.Tensor,
        key_dim: int = 1,
        offset_per_key: Optional[List[int]] = None,
        index_per_key: Optional[Dict[str, int]] = None,
    ) -> None:
        keys = list(keys)
        length_per_key = list(length_per_key)
        if not set(map(type, length_per_key)) <= {int}:  # the per-key loop only when some is not an int
            length_per_key = [int(n) for n in length_per_key]
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"{_OWNER}: values must be a torch.Tensor, got {type(values).__name__}")
        if not keys and not length_per_key and values.numel() == 0:
            # torchrec's empty KeyedTensor([], [], torch.Tensor()): no key, nothing to lay out
            key_dim = key_dim if values.dim() > key_dim >= 0 else values.dim() - 1
        if not -values.dim() <= key_dim < max(values.dim(), 1):
            raise ValueError(f"{_OWNER}: key_dim {key_dim} is out of range for values {tuple(values.shape)}")
        if len(keys) != len(length_per_key):
            raise ValueError(
                f"{_OWNER}: {len(keys)} keys but {len(length_per_key)} entries in length_per_key"
            )
        negative = (
            [(k, n) for k, n in zip(keys, length_per_key) if n < 0]
            if min(length_per_key, default=0) < 0
            else []
        )
        if negative:
            raise ValueError(f"{_OWNER}: negative length for key {negative[0][0]!r}: {negative[0][1]}")
        if sum(length_per_key) != values.size(key_dim):
            raise ValueError(
                f"{_OWNER}: length_per_key sums to {sum(length_per_key)} but values has "
                f"{values.size(key_dim)} along key_dim {key_dim} (shape {tuple(values.shape)})"
            )
        self._keys = keys
        self._length_per_key = length_per_key
        self._values = values
        self._key_dim = key_dim % values.dim()
        self._offset_per_key = offset_per_key or [0, *accumulate(length_per_key)]
        self._index_per_key = index_per_key

    @staticmethod
    def from_tensor_list(
        keys: List[str], tensors: List[torch.Tensor], key_dim: int = 1, cat_dim: int = 1
    ) -> KeyedTensor:
        """Concatenate one tensor per key along ``cat_dim``; the widths come from ``key_dim``."""
        if len(keys) != len(tensors):
            raise ValueError(f"{_OWNER}.from_tensor_list: {len(keys)} keys but {len(tensors)} tensors")
        if not tensors:
            raise ValueError(f"{_OWNER}.from_tensor_list needs at least one tensor")
        return KeyedTensor(keys, [t.size(key_dim) for t in tensors], torch.cat(tensors, cat_dim), key_dim)

    def keys(self) -> List[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def device(self) -> torch.device:
        return self._values.device

    def length_per_key(self) -> List[int]:
        return self._length_per_key

    def offset_per_key(self) -> List[int]:
        """K + 1 offsets along ``key_dim``, starting at 0."""
        return self._offset_per_key

    def index_per_key(self) -> Dict[str, int]:
        if self._index_per_key is None:
            index: Dict[str, int] = {}
            for i, key in enumerate(self._keys):
                index.setdefault(key, i)
            self._index_per_key = index
        return self._index_per_key

    def __getitem__(self, key: str) -> torch.Tensor:
        """The slice of ``key``: a view ``[B, length]`` (for key_dim 1)."""
        index = self.index_per_key().get(key)
        if index is None:
            raise unknown_key_error(_OWNER, key, self._keys)
        return self._values.narrow(self._key_dim, self._offset_per_key[index], self._length_per_key[index])

    def to_dict(self) -> Dict[str, torch.Tensor]:
        """Key -> view of its slice (first occurrence of a repeated key)."""
        parts = torch.split(self._values, self._length_per_key, dim=self._key_dim)
        out: Dict[str, torch.Tensor] = {}
        for key, part in zip(self._keys, parts):
            out.setdefault(key, part)
        return out

    @staticmethod
    def regroup(keyed_tensors: List[KeyedTensor], groups: List[List[str]]) -> List[torch.Tensor]:
        """One tensor per group: the slices of the group's keys, in order, concatenated along key_dim.

        Keys are looked up across all ``keyed_tensors`` (first occurrence wins); runs of keys that are
        adjacent in the same KeyedTensor are copied as one slice. All inputs must share key_dim and the
        other dimensions.
        """
        return _regroup(keyed_tensors, groups)

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: List[KeyedTensor], groups: List[List[str]], keys: List[str]
    ) -> Dict[str, torch.Tensor]:
        """:meth:`regroup` with the i-th group named ``keys[i]``."""
        if len(keys) != len(groups):
            raise ValueError(f"{_OWNER}.regroup_as_dict: {len(groups)} groups but {len(keys)} names")
        grouped = KeyedTensor.regroup(keyed_tensors, groups)
        # indexed, not zipped: under fx tracing ``grouped`` is one traced value
        return {key: grouped[i] for i, key in enumerate(keys)}

    def to(self, device: torch.device, non_blocking: bool = False) -> KeyedTensor:
        return self._with_values(self._values.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> KeyedTensor:
        return self._with_values(self._values.pin_memory())

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self._values.record_stream(stream)

    def _with_values(self, values: torch.Tensor) -> KeyedTensor:
        return KeyedTensor(
            self._keys, self._length_per_key, values, self._key_dim, self._offset_per_key, self._index_per_key
        )

    def __str__(self) -> str:
        """Each key's rows, in torchrec's format; reads the values back to the host."""
        return keyed_tensor_string(self._keys, [self[key] for key in self._keys])

    def __repr__(self) -> str:
        shape = tuple(self._values.shape)
        return f"KeyedTensor(keys={self._keys}, length_per_key={self._length_per_key}, values={shape})"


def _regroup(keyed_tensors: List[KeyedTensor], groups: List[List[str]]) -> List[torch.Tensor]:
    """The body of :meth:`KeyedTensor.regroup` (a module-level function so that fx can wrap it)."""
    locate = _locator(keyed_tensors)
    key_dim = keyed_tensors[0].key_dim()
    out = []
    for group in groups:
        pieces = _merged_slices([locate(key) for key in group])
        tensors = [keyed_tensors[t].values().narrow(key_dim, start, size) for t, start, size in pieces]
        if not tensors:
            empty_shape = list(keyed_tensors[0].values().shape)
            empty_shape[key_dim] = 0
            tensors = [keyed_tensors[0].values().new_empty(empty_shape)]
        out.append(torch.cat(tensors, dim=key_dim) if len(tensors) > 1 else tensors[0].clone())
    return out


# a leaf of fx graphs: tracing records one call instead of running the body on traced values
torch.fx.wrap("_regroup")


def regroup_kts(keyed_tensors: List[KeyedTensor], groups: List[List[str]]) -> List[torch.Tensor]:
    """torchrec's ``regroup_kts``: :meth:`KeyedTensor.regroup`."""
    return KeyedTensor.regroup(keyed_tensors, groups)


def permute_multi_embedding(keyed_tensors: List[KeyedTensor], groups: List[List[str]]) -> List[torch.Tensor]:
    """torchrec's ``permute_multi_embedding`` (its fused regroup kernel): :meth:`KeyedTensor.regroup`."""
    return KeyedTensor.regroup(keyed_tensors, groups)


def _locator(keyed_tensors: Sequence[KeyedTensor]):
    """Returns key -> (tensor index, offset, length), checking that the inputs can be concatenated."""
    if not keyed_tensors:
        raise ValueError(f"{_OWNER}.regroup needs at least one KeyedTensor")
    first = keyed_tensors[0]
    reference = list(first.values().shape)
    reference[first.key_dim()] = -1
    where: Dict[str, Tuple[int, int, int]] = {}
    for t, kt in enumerate(keyed_tensors):
        shape = list(kt.values().shape)
        shape[kt.key_dim()] = -1
        if kt.key_dim() != first.key_dim() or shape != reference:
            raise ValueError(
                f"{_OWNER}.regroup: keyed tensor {t} has shape {tuple(kt.values().shape)} / key_dim "
                f"{kt.key_dim()}, incompatible with {tuple(first.values().shape)} / key_dim {first.key_dim()}"
            )
        for key, start, size in zip(kt.keys(), kt.offset_per_key(), kt.length_per_key()):
            where.setdefault(key, (t, start, size))

    def locate(key: str) -> Tuple[int, int, int]:
        if key not in where:
            raise unknown_key_error(f"{_OWNER}.regroup", key, list(where))
        return where[key]

    return locate


def _merged_slices(slices: Sequence[Tuple[int, int, int]]) -> List[Tuple[int, int, int]]:
    """Merge consecutive (tensor, start, size) slices that are contiguous in the same tensor."""
    merged: List[Tuple[int, int, int]] = []
    for t, start, size in slices:
        if merged and merged[-1][0] == t and merged[-1][1] + merged[-1][2] == start:
            merged[-1] = (t, merged[-1][1], merged[-1][2] + size)
        else:
            merged.append((t, start, size))
    return merged
