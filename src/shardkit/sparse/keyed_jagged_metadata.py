"""Host-side metadata of a KeyedJaggedTensor: batch size per key, inverse indices, per-key totals.

Everything here reads Python values and tensor shapes only, so it never synchronizes with the device.
"""

from __future__ import annotations

from itertools import accumulate
from typing import List, Optional, Tuple

import torch

from shardkit.sparse.validation import check_tensor

try:
    from torch.fx.experimental.symbolic_shapes import guard_or_false as _symbolic_guard_or_false
except ImportError:  # older torch releases: no unbacked symbols to guard on, a plain bool does
    _symbolic_guard_or_false = bool


def guard_or_false(condition) -> bool:
    """torch's ``guard_or_false``: a symbolic condition that cannot be decided is False. A plain bool
    (plain ints compared, every KJT built outside ``torch.export``) is answered without torch's
    symbolic machinery, which costs a few Python calls per KJT."""
    if condition is True or condition is False:
        return condition
    return _symbolic_guard_or_false(condition)


_OWNER = "KeyedJaggedTensor"

InverseIndices = Tuple[List[str], torch.Tensor]


def resolve_stride(
    keys: List[str], rows: int, stride: Optional[int], stride_per_key_per_rank: Optional[List[List[int]]]
) -> Tuple[int, Optional[List[List[int]]]]:
    """(stride, stride_per_key_per_rank or None): the given values checked, or inferred from the rows."""
    if stride is not None and stride < 0:
        raise ValueError(f"{_OWNER}: stride must be >= 0, got {stride}")
    if stride_per_key_per_rank is not None:
        per_rank = [[int(n) for n in ranks] for ranks in stride_per_key_per_rank]
        if len(per_rank) != len(keys):
            raise ValueError(
                f"{_OWNER}: stride_per_key_per_rank has {len(per_rank)} entries for {len(keys)} keys {keys}"
            )
        negative = [(k, r) for k, r in zip(keys, per_rank) if any(n < 0 for n in r)]
        if negative:
            raise ValueError(f"{_OWNER}: negative stride for feature {negative[0][0]!r}: {negative[0][1]}")
        inferred = max((sum(r) for r in per_rank), default=0)
        return (inferred if stride is None else stride), per_rank
    if stride is None:
        if not keys:
            return 0, None
        if rows % len(keys):
            raise ValueError(
                f"{_OWNER}: {rows} lengths cannot be split evenly over {len(keys)} keys {keys}; pass "
                "stride_per_key_per_rank for a variable batch size per feature"
            )
        return rows // len(keys), None
    return stride, None


def rows_mismatch(keys: List[str], stride_per_key: List[int], stride: int, rows: int) -> str:
    """The error message for a number of lengths that does not fit the keys and strides."""
    if len(set(stride_per_key)) <= 1:
        need = len(keys) * stride
        return f"{_OWNER}: {len(keys)} keys {keys} with stride {stride} need {need} lengths, got {rows}"
    need = sum(stride_per_key)
    return f"{_OWNER}: stride_per_key {stride_per_key} for keys {keys} needs {need} lengths, got {rows}"


def checked_inverse_indices(
    inverse_indices: Optional[InverseIndices], kjt_keys: List[str], device: torch.device
) -> Optional[InverseIndices]:
    """``(keys, [K, B] table)`` after the shape / key / device checks (contents: see validation)."""
    if inverse_indices is None:
        return None
    keys, table = inverse_indices
    keys = list(keys)
    # rows of the table follow the keys through permute / split, so they must be the same keys
    if keys != kjt_keys:
        raise ValueError(f"{_OWNER}: inverse_indices keys {keys} must equal the keys {kjt_keys}")
    check_tensor(_OWNER, "inverse_indices", table, integer=True)
    if table.dim() != 2 or table.size(0) != len(keys):
        raise ValueError(
            f"{_OWNER}: inverse_indices tensor must be [num_keys={len(keys)}, batch], "
            f"got {tuple(table.shape)}"
        )
    if table.device != device:
        raise ValueError(f"{_OWNER}: inverse_indices is on {table.device} but values are on {device}")
    return keys, table


def _host_int(n):
    """``int(n)``, except that a symbolic int (``torch.export`` tracing) stays symbolic."""
    return n if isinstance(n, torch.SymInt) else int(n)


def _host_ints(values) -> List:
    """``[_host_int(n) for n in values]``, at C speed when every entry is a plain int (the usual case:
    a per-key loop of Python calls cost ~1 us per key and step)."""
    values = list(values)
    if set(map(type, values)) <= _PLAIN_INT:
        return values
    return [_host_int(n) for n in values]


_PLAIN_INT = {int}


def cached_offsets(
    keys: List[str], num_values: int, length_per_key: Optional[List[int]], offset_per_key: Optional[List[int]]
) -> Optional[List[int]]:
    """Caller-supplied per-key totals, checked against what is known on the host (no sync)."""
    if offset_per_key is None and length_per_key is None:
        return None
    if offset_per_key is None:
        if len(length_per_key) != len(keys):
            raise ValueError(
                f"{_OWNER}: length_per_key has {len(length_per_key)} entries for {len(keys)} keys"
            )
        offset_per_key = [0, *accumulate(_host_ints(length_per_key))]
    else:
        offset_per_key = _host_ints(offset_per_key)
    if (
        len(offset_per_key) != len(keys) + 1
        or guard_or_false(offset_per_key[-1] > num_values)
        or guard_or_false(offset_per_key[0] != 0)
    ):
        raise ValueError(
            f"{_OWNER}: per-key totals (length_per_key / offset_per_key) give offsets {offset_per_key}; "
            f"expected {len(keys) + 1} entries from 0 to at most the number of values {num_values}"
        )
    return offset_per_key
