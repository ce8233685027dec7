"""JaggedTensor: a batch of variable-length rows (one feature), stored flat.

``values [N, *D]`` holds all rows back to back; ``lengths [B]`` (or ``offsets [B + 1]``, starting at 0)
says where each of the B rows starts and ends. ``weights [N]`` (float) optionally weight each value.
Either of lengths / offsets is enough; the other is derived on first use and cached.
"""

from __future__ import annotations

import importlib
from typing import List, Optional

import torch
import torch.fx

from shardkit.sparse.jagged_fields import JaggedFields
from shardkit.sparse.jagged_ops import (
    host_list_to_device,
    padded_dense,
)
from shardkit.sparse.printing import jagged_tensor_string
from shardkit.sparse.validation import (
    as_lengths_and_offsets,
    check_lengths_offsets_sizes,
    check_same_device,
    check_tensor,
    check_weights,
    segment_offsets_with_sync,
)

_OWNER = "JaggedTensor"


class JaggedTensor(JaggedFields):
    """B variable-length rows of ``values``.

    Args:
        values: ``[N]`` ids (any integer dtype) or ``[N, *D]`` embeddings (any dtype).
        weights: optional ``[N]`` per-value weights (float).
        lengths: ``[B]`` row lengths (int32 / int64; an empty one of any dtype).
        offsets: ``[B + 1]`` row starts, ``offsets[0] == 0``, same dtype family.
        validate: check lengths / offsets against ``values`` (one host sync; see
            :mod:`shardkit.sparse.validation`). Shape checks always run. Values past the end the
            lengths give are ignored (validated: ``values()`` drops them).
    """

    def __init__(
        self,
        values: torch.Tensor,
        weights: Optional[torch.Tensor] = None,
        lengths: Optional[torch.Tensor] = None,
        offsets: Optional[torch.Tensor] = None,
        *,
        validate: bool = True,
    ) -> None:
        check_tensor(_OWNER, "values", values)
        if values.dim() == 0:
            raise ValueError(f"{_OWNER}: values must have at least one dimension, got a scalar")
        lengths, offsets = as_lengths_and_offsets(_OWNER, values, lengths, offsets)
        batch = check_lengths_offsets_sizes(_OWNER, lengths, offsets)
        check_weights(_OWNER, values, weights)
        check_same_device(_OWNER, values, weights=weights, lengths=lengths, offsets=offsets)
        if validate:
            end = segment_offsets_with_sync(_OWNER, lengths, offsets, [0, batch], values.size(0), None, True)[
                -1
            ]
            if end < values.size(0):  # the tail is no row's: drop it (a view)
                values, weights = values[:end], None if weights is None else weights[:end]
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: Optional[torch.device] = None,
        values_dtype: Optional[torch.dtype] = None,
        weights_dtype: Optional[torch.dtype] = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> JaggedTensor:
        """A JaggedTensor with no rows (B = 0, N = 0); ``offsets()`` is empty too, as torchrec's."""
        values = torch.empty(0, dtype=values_dtype or torch.long, device=device)
        weights = torch.empty(0, dtype=weights_dtype or torch.float, device=device) if is_weighted else None
        lengths = torch.empty(0, dtype=lengths_dtype, device=device)
        empty = JaggedTensor(values, weights, lengths, validate=False)
        empty._offsets = torch.empty(0, dtype=lengths_dtype, device=device)  # torchrec: [], not [0]
        return empty

    @staticmethod
    def empty_like(jt: JaggedTensor, device: Optional[torch.device] = None) -> JaggedTensor:
        """A JaggedTensor with no rows, with ``jt``'s dtypes and weightedness, on ``device`` (default:
        ``jt``'s)."""
        weights = jt.weights_or_none()
        return JaggedTensor.empty(
            weights is not None,
            device or jt.device(),
            jt.values().dtype,
            None if weights is None else weights.dtype,
            jt.lengths().dtype,
        )

    @staticmethod
    def from_dense(values: List[torch.Tensor], weights: Optional[List[torch.Tensor]] = None) -> JaggedTensor:
        """One row per tensor of ``values`` (each ``[n_i, *D]``), int32 lengths as torchrec; no host sync."""
        if len(values) == 0:
            raise ValueError(f"{_OWNER}.from_dense needs at least one row; use JaggedTensor.empty()")
        if weights is not None and [w.size(0) for w in weights] != [v.size(0) for v in values]:
            raise ValueError(
                f"{_OWNER}.from_dense: weights rows have sizes {[w.size(0) for w in weights]} "
                f"but values rows have {[v.size(0) for v in values]}"
            )
        device = values[0].device
        lengths = host_list_to_device([v.size(0) for v in values], device).to(torch.int32)
        cat_weights = torch.cat(weights) if weights is not None else None
        return JaggedTensor(torch.cat(values), cat_weights, lengths, validate=False)

    @staticmethod
    def from_dense_lengths(
        values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor] = None
    ) -> JaggedTensor:
        """Row ``b`` is ``values[b, :lengths[b]]`` of a padded ``[B, L, *D]``.

        Syncs with the host twice: to check lengths and to size the boolean-mask result. Under
        ``torch.fx`` symbolic tracing it is one leaf call (as torchrec's), run when the graph runs.
        """
        return _from_dense_lengths(values, lengths, weights)

    def to_dense(self) -> List[torch.Tensor]:
        """The B rows as views ``[n_b, *D]`` of values; one host sync (the lengths)."""
        return list(torch.split(self._values, self.lengths().tolist()))

    def to_dense_weights(self) -> Optional[List[torch.Tensor]]:
        """The B rows of weights, or None if unweighted; one host sync."""
        if self._weights is None:
            return None
        return list(torch.split(self._weights, self.lengths().tolist()))

    def to_padded_dense(
        self, desired_length: Optional[int] = None, padding_value: float = 0.0
    ) -> torch.Tensor:
        """``[B, L, *D]`` with rows truncated / padded to L (default: the longest row, one host sync)."""
        return padded_dense(
            self._values, self.lengths(), self.offsets(), self._pad_length(desired_length), padding_value
        )

    def to_padded_dense_weights(
        self, desired_length: Optional[int] = None, padding_value: float = 0.0
    ) -> Optional[torch.Tensor]:
        """``[B, L]`` weights like :meth:`to_padded_dense`, or None if unweighted."""
        if self._weights is None:
            return None
        return padded_dense(
            self._weights, self.lengths(), self.offsets(), self._pad_length(desired_length), padding_value
        )

    def _pad_length(self, desired_length: Optional[int]) -> int:
        if desired_length is not None:
            if desired_length < 0:
                raise ValueError(f"{_OWNER}: desired_length must be >= 0, got {desired_length}")
            return desired_length
        lengths = self.lengths()
        return int(lengths.max()) if lengths.numel() else 0

    def to(self, device: torch.device, non_blocking: bool = False) -> JaggedTensor:
        """This tensor on ``device`` (tensors already there are shared, not copied)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> JaggedTensor:
        """A copy in page-locked host memory, for asynchronous host-to-device copies (needs CUDA)."""
        return self._map(lambda t: t.pin_memory())

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark every tensor as used by ``stream`` so the caching allocator does not reuse it early."""
        for tensor in (self._values, self._weights, self._lengths, self._offsets):
            if tensor is not None:
                tensor.record_stream(stream)

    def _map(self, fn) -> JaggedTensor:
        def apply(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if tensor is None else fn(tensor)

        return JaggedTensor(
            fn(self._values), apply(self._weights), apply(self._lengths), apply(self._offsets), validate=False
        )

    def __str__(self) -> str:
        """Every row's values (and weights), in torchrec's format; reads them back to the host."""
        return jagged_tensor_string(self._values, self._weights, self.offsets())

    def __repr__(self) -> str:
        rows = (self._lengths if self._lengths is not None else self._offsets[1:]).numel()
        weighted = ", weighted" if self._weights is not None else ""
        return f"JaggedTensor(rows={rows}, values={tuple(self._values.shape)}{weighted})"


def _from_dense_lengths(
    values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor] = None
) -> JaggedTensor:
    """The body of :meth:`JaggedTensor.from_dense_lengths` (module level, so that fx can wrap it)."""
    if values.dim() < 2 or lengths.shape != values.shape[:1]:
        raise ValueError(
            f"{_OWNER}.from_dense_lengths: values must be [B, L, ...] and lengths [B], got "
            f"{tuple(values.shape)} and {tuple(lengths.shape)}"
        )
    if weights is not None and weights.shape != values.shape[:2]:
        raise ValueError(
            f"{_OWNER}.from_dense_lengths: weights must be [B, L] = {tuple(values.shape[:2])}, "
            f"got {tuple(weights.shape)}"
        )
    if bool(((lengths < 0) | (lengths > values.size(1))).any()):
        raise ValueError(f"{_OWNER}.from_dense_lengths: lengths must lie in [0, {values.size(1)}]")
    mask = torch.arange(values.size(1), device=values.device) < lengths.unsqueeze(1)
    kept = mask.view(-1).nonzero().squeeze(1)  # the one sync that sizes the result, shared below
    flat_values = values.reshape(-1, *values.shape[2:]).index_select(0, kept)
    kept_weights = weights.reshape(-1).index_select(0, kept) if weights is not None else None
    return JaggedTensor(flat_values, kept_weights, lengths, validate=False)


# a leaf of fx graphs: the checks and the data-dependent result size run when the graph runs
torch.fx.wrap("_from_dense_lengths")


# torchrec's ``torchrec.sparse.jagged_tensor`` also holds these; they live in their own files here, which
# import this one, so they are read on first use (docs/names.md, "torchrec's module tree").
_TORCHREC_NAMES = {
    "KeyedJaggedTensor": "shardkit.sparse.keyed_jagged_tensor",
    "KeyedTensor": "shardkit.sparse.keyed_tensor",
    "ComputeJTDictToKJT": "shardkit.sparse.conversion_modules",
    "ComputeKJTToJTDict": "shardkit.sparse.conversion_modules",
    "jt_is_equal": "shardkit.sparse.comparison",
    "kjt_is_equal": "shardkit.sparse.comparison",
    "permute_multi_embedding": "shardkit.sparse.keyed_tensor",
    "regroup_kts": "shardkit.sparse.keyed_tensor",
}


def __getattr__(name: str):
    if name in _TORCHREC_NAMES:
        return getattr(importlib.import_module(_TORCHREC_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
