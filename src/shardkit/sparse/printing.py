"""``str()`` of the jagged types in torchrec's format: every row's values, one key per line.

``JaggedTensor({\\n    [[1.0], [2.0, 3.0]]\\n})\\n``; with weights, ``"values"`` and ``"weights"`` entries;
a KeyedJaggedTensor has one ``"key": rows`` line per key, a KeyedTensor one ``"key": [[...], ...]`` line
per key (its rows). Printing reads the tensors back to the host (a sync): it is for people, not loops.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

_INDENT = "    "


def _rows(values: list, offsets: Sequence[int], start: int, end: int) -> str:
    """``[[row start], ..., [row end - 1]]`` of host ``values`` split at host ``offsets``."""
    rows = [", ".join(str(v) for v in values[offsets[i] : offsets[i + 1]]) for i in range(start, end)]
    return "[" + ", ".join(f"[{row}]" for row in rows) + "]"


def _entry(
    values: list, weights: Optional[list], offsets: Sequence[int], start: int, end: int, indent: str
) -> str:
    if weights is None:
        return _rows(values, offsets, start, end)
    inner = indent + _INDENT
    return (
        f'{{\n{inner}"values": {_rows(values, offsets, start, end)},\n'
        f'{inner}"weights": {_rows(weights, offsets, start, end)}\n{indent}}}'
    )


def jagged_tensor_string(values: torch.Tensor, weights: Optional[torch.Tensor], offsets: torch.Tensor) -> str:
    if values.dim() > 2:
        # torchrec's rule: a row of a JaggedTensor prints as a list of ids or of 1-D rows
        raise ValueError(
            f"JaggedTensor: str() prints values of 1 or 2 dimensions, got shape {tuple(values.shape)}; "
            "print jt.values() and jt.lengths() instead"
        )
    host_offsets = offsets.tolist()
    rows = max(len(host_offsets) - 1, 0)
    host_weights = None if weights is None else weights.tolist()
    if host_weights is None:
        body = _INDENT + _rows(values.tolist(), host_offsets, 0, rows)
    else:
        body = (
            f'{_INDENT}"values": {_rows(values.tolist(), host_offsets, 0, rows)},\n'
            f'{_INDENT}"weights": {_rows(host_weights, host_offsets, 0, rows)}'
        )
    return "JaggedTensor({\n" + body + "\n})\n"


def keyed_jagged_tensor_string(
    keys: List[str], values: torch.Tensor, weights: Optional[torch.Tensor], offsets: torch.Tensor, row_bounds
) -> str:
    if not keys:
        return "KeyedJaggedTensor()\n"
    host_values, host_offsets = values.tolist(), offsets.tolist()
    host_weights = None if weights is None else weights.tolist()
    lines = [
        f'{_INDENT}"{key}": '
        + _entry(host_values, host_weights, host_offsets, row_bounds[k], row_bounds[k + 1], _INDENT)
        for k, key in enumerate(keys)
    ]
    return "KeyedJaggedTensor({\n" + ",\n".join(lines) + "\n})\n"


def keyed_tensor_string(keys: List[str], per_key: List[torch.Tensor]) -> str:
    if not keys:
        return "KeyedTensor()\n"
    lines = [f'{_INDENT}"{key}": {tensor.tolist()}' for key, tensor in zip(keys, per_key)]
    return "KeyedTensor({\n" + ",\n".join(lines) + "\n})\n"
