"""fbgemm's jagged ops that torchrec programs call as ``torch.ops.fbgemm.*``, on shardkit's jagged code.

The functions here are plain torch (any device, differentiable where fbgemm's are: in ``values`` /
``dense``). :func:`register` defines them as ``torch.ops.fbgemm.<name>`` with fbgemm's schemas; only the
run-as-torchrec mode calls it (shardkit.cli.torchrec_mode), so ``torch.ops.fbgemm`` is left alone
otherwise. Only one jagged dimension is supported (fbgemm's ``x_offsets`` lists of length 1).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from shardkit.sparse.jagged_ops import complete_cumsum, padded_dense, values_of_padded


def _check_offsets(op: str, offsets: torch.Tensor) -> None:
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{op}: offsets must be 1-D [B + 1], got shape {tuple(offsets.shape)}")


def jagged_2d_to_dense(values: torch.Tensor, offsets: torch.Tensor, max_sequence_length: int) -> torch.Tensor:
    """Rows of ``values [N, D]`` cut by ``offsets [B + 1]`` (``N = offsets[-1]``) as ``[B,
    max_sequence_length, D]``: rows longer than ``max_sequence_length`` truncated, shorter ones padded
    with 0."""
    if values.dim() != 2:
        raise ValueError(f"jagged_2d_to_dense: values must be 2-D [N, D], got shape {tuple(values.shape)}")
    _check_offsets("jagged_2d_to_dense", offsets)
    if max_sequence_length < 0:
        raise ValueError(f"jagged_2d_to_dense: max_sequence_length must be >= 0, got {max_sequence_length}")
    lengths = offsets[1:] - offsets[:-1]
    return padded_dense(values, lengths, offsets, int(max_sequence_length), 0.0)


def dense_to_jagged(
    dense: torch.Tensor, x_offsets: List[torch.Tensor], total_L: Optional[int] = None
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``(values [total_L, *D], x_offsets)``: row ``b`` of ``dense [B, L, *D]`` cut to its length
    ``x_offsets[0][b + 1] - x_offsets[0][b]`` (positions past ``L`` are 0). ``total_L`` (the number of
    values, ``x_offsets[0][-1]``) saves a host sync when given."""
    if len(x_offsets) != 1:
        raise ValueError(
            f"dense_to_jagged: shardkit supports one jagged dimension (x_offsets of length 1), got "
            f"{len(x_offsets)}"
        )
    offsets = x_offsets[0]
    _check_offsets("dense_to_jagged", offsets)
    if dense.dim() < 2 or dense.size(0) != offsets.numel() - 1:
        raise ValueError(
            f"dense_to_jagged: dense must be [B, L, ...] with B = len(offsets) - 1 = {offsets.numel() - 1}, "
            f"got shape {tuple(dense.shape)}"
        )
    num_values = int(offsets[-1]) if total_L is None else int(total_L)
    return values_of_padded(dense, offsets, num_values), list(x_offsets)


def asynchronous_complete_cumsum(t_in: torch.Tensor) -> torch.Tensor:
    """Offsets of lengths: ``[n] -> [n + 1]`` starting at 0 (a 2-D ``[R, n]`` gives ``[R, n + 1]``, one
    cumsum per row); same dtype, no host sync."""
    if t_in.dim() == 1:
        return complete_cumsum(t_in)
    if t_in.dim() == 2:
        return torch.cat([t_in.new_zeros(t_in.size(0), 1), torch.cumsum(t_in, 1, dtype=t_in.dtype)], 1)
    raise ValueError(
        f"asynchronous_complete_cumsum: expected a 1-D or 2-D tensor, got shape {tuple(t_in.shape)}"
    )


def asynchronous_inclusive_cumsum(t_in: torch.Tensor) -> torch.Tensor:
    """``cumsum`` of a 1-D tensor in its own dtype."""
    return torch.cumsum(t_in, 0, dtype=t_in.dtype)


def asynchronous_exclusive_cumsum(t_in: torch.Tensor) -> torch.Tensor:
    """Offsets without the last one: ``[n] -> [n]`` starting at 0."""
    return complete_cumsum(t_in)[:-1]


# fbgemm's schemas, so that calls with its keywords work as on fbgemm
_SCHEMAS = {
    "jagged_2d_to_dense": "jagged_2d_to_dense(Tensor values, Tensor offsets, SymInt max_sequence_length)"
    " -> Tensor",
    "dense_to_jagged": "dense_to_jagged(Tensor dense, Tensor[] x_offsets, SymInt? total_L=None)"
    " -> (Tensor, Tensor[])",
    "asynchronous_complete_cumsum": "asynchronous_complete_cumsum(Tensor t_in) -> Tensor",
    "asynchronous_inclusive_cumsum": "asynchronous_inclusive_cumsum(Tensor t_in) -> Tensor",
    "asynchronous_exclusive_cumsum": "asynchronous_exclusive_cumsum(Tensor t_in) -> Tensor",
}
_FUNCTIONS = {
    "jagged_2d_to_dense": jagged_2d_to_dense,
    "dense_to_jagged": dense_to_jagged,
    "asynchronous_complete_cumsum": asynchronous_complete_cumsum,
    "asynchronous_inclusive_cumsum": asynchronous_inclusive_cumsum,
    "asynchronous_exclusive_cumsum": asynchronous_exclusive_cumsum,
}
_LIBRARY: Optional[torch.library.Library] = None


def registered() -> bool:
    """Whether :func:`register` has run in this process."""
    return _LIBRARY is not None


def register() -> None:
    """Define the ops above as ``torch.ops.fbgemm.<name>`` (idempotent). An op that the process already
    has (a real fbgemm_gpu loaded earlier) is kept. Composite implementations: autograd goes through
    the torch code above."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    library = torch.library.Library("fbgemm", "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        if torch._C._dispatch_has_kernel(f"fbgemm::{name}"):
            continue
        library.define(schema)
        library.impl(name, _FUNCTIONS[name], "CompositeImplicitAutograd")
    _LIBRARY = library
