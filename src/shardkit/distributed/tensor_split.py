"""Splitting, padding and trimming tensors along one dimension (local tensor code, no communication).

Uneven splits follow numpy's ``array_split`` rule everywhere in shardkit: ``total`` elements over ``n``
parts give the first ``total % n`` parts one more element than the rest, so every part exists (possibly
empty) and part sizes differ by at most one.
"""

from __future__ import annotations

from typing import Sequence

import torch


def ensure_div(a: int, b: int) -> None:
    """Raise ``ValueError`` naming ``a`` and ``b`` unless ``b`` divides ``a`` (``b`` must be non-zero)."""
    if b == 0:
        raise ValueError(f"cannot divide a={a} by b={b}")
    if a % b != 0:
        raise ValueError(f"b={b} does not divide a={a} (remainder {a % b})")


def divide_and_check_no_remainder(a: int, b: int) -> int:
    """``a // b``, raising ``ValueError`` naming ``a`` and ``b`` when ``b`` does not divide ``a``."""
    ensure_div(a, b)
    return a // b


def split_sizes(total: int, num_parts: int) -> list[int]:
    """Sizes of ``num_parts`` parts of ``total`` elements by the ``array_split`` rule.

    >>> split_sizes(5, 3)
    [2, 2, 1]
    >>> split_sizes(2, 3)
    [1, 1, 0]
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    base, extra = divmod(total, num_parts)
    return [base + 1 if part < extra else base for part in range(num_parts)]


def split_offsets(sizes: Sequence[int]) -> list[int]:
    """Start offset of each part: the exclusive prefix sum of ``sizes``."""
    offsets, running = [], 0
    for size in sizes:
        offsets.append(running)
        running += size
    return offsets


def normalize_dim(tensor: torch.Tensor, dim: int) -> int:
    """``dim`` as a non-negative index into ``tensor``'s dimensions; ``IndexError`` when out of range."""
    ndim = tensor.dim()
    if ndim == 0:
        raise IndexError("a 0-d tensor has no dimension to split, pad or trim")
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim {dim} is out of range for a tensor of {ndim} dimensions")
    return dim % ndim


def pad_tensor(tensor: torch.Tensor, dim: int = -1, *, target_size: int) -> torch.Tensor:
    """Append zeros to ``tensor`` along ``dim`` until its size there is ``target_size``.

    ``[..., n, ...]`` -> ``[..., target_size, ...]``, same dtype and device. Returns ``tensor`` itself
    when no padding is needed; otherwise a new tensor (the input is never modified). Zeros, unlike
    uninitialized memory, make padded results deterministic and keep NaN/Inf out of later reductions.
    Differentiable (``torch.cat``): the padding receives no gradient and nothing is saved for backward.
    """
    dim = normalize_dim(tensor, dim)
    size = tensor.size(dim)
    if target_size < size:
        raise ValueError(f"target_size {target_size} is smaller than the size {size} of dim {dim}")
    if target_size == size:
        return tensor
    pad_shape = list(tensor.shape)
    pad_shape[dim] = target_size - size
    return torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)


def trim_tensor(tensor: torch.Tensor, dim: int = -1, *, target_size: int) -> torch.Tensor:
    """Keep the first ``target_size`` entries of ``tensor`` along ``dim`` (the inverse of ``pad_tensor``).

    ``[..., n, ...]`` -> ``[..., target_size, ...]``: a view of the input (``narrow``), never a copy.
    """
    dim = normalize_dim(tensor, dim)
    size = tensor.size(dim)
    if not 0 <= target_size <= size:
        raise ValueError(f"target_size {target_size} is not in [0, {size}] (the size of dim {dim})")
    return tensor.narrow(dim, 0, target_size)


def split_tensor(
    tensor: torch.Tensor,
    num_parts: int,
    dim: int = -1,
    contiguous_chunks: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Split ``tensor`` into exactly ``num_parts`` chunks along ``dim`` by the ``array_split`` rule.

    Chunk ``i`` has shape ``[..., split_sizes(n, num_parts)[i], ...]``; chunks may be empty. They are
    views of the input unless ``contiguous_chunks``, which makes each one contiguous (a copy where the
    view is not contiguous already, e.g. along the last dim of a 2-d tensor).
    """
    dim = normalize_dim(tensor, dim)
    chunks = torch.split(tensor, split_sizes(tensor.size(dim), num_parts), dim=dim)
    if contiguous_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return tuple(chunks)
