"""KeyedJaggedTensor: a batch of several sparse features, each a JaggedTensor, stored key-major.

Layout (K keys, batch size / stride B)::

    keys     = ["f1", "f2"]
    lengths  = [ f1: l(0) .. l(B-1) | f2: l(0) .. l(B-1) ]     [K * B]   (int32 / int64)
    values   = [ f1 ids of sample 0, 1, ... | f2 ids ... ]     [N]       (ids, any integer dtype)
    weights  = one float per value, optional                   [N]
    offsets  = complete cumulative sum of lengths               [K * B + 1]

With a *variable batch size per feature* (``stride_per_key_per_rank``), key k has
``stride_per_key()[k] = sum(stride_per_key_per_rank[k])`` rows instead of B, and ``inverse_indices``
(``(keys, [K, B] int tensor)``) maps each sample of the full batch to its row of that key.

Host syncs: only ``length_per_key`` / ``offset_per_key`` (and methods that need them: ``split``,
``permute``, ``to_dict``, ``__getitem__``, ``sync``) read tensor contents on the host, once; the result is
cached and carried to every derived KeyedJaggedTensor. A constructor with ``validate=True`` computes
them in its single validation sync. Everything else is asynchronous.
"""

from __future__ import annotations

import operator
from itertools import accumulate
from typing import Dict, List, Optional, Tuple

import torch

from shardkit.sparse.jagged_fields import JaggedFields
from shardkit.sparse.jagged_ops import (
    host_list_to_device,
    take_segments,
)
from shardkit.sparse.jagged_tensor import JaggedTensor
from shardkit.sparse.keyed_jagged_metadata import (
    InverseIndices,
    cached_offsets,
    checked_inverse_indices,
    guard_or_false,
    resolve_stride,
    rows_mismatch,
)
from shardkit.sparse.keyed_tensor import unknown_key_error
from shardkit.sparse.printing import keyed_jagged_tensor_string
from shardkit.sparse.validation import (
    as_lengths_and_offsets,
    check_lengths_offsets_sizes,
    check_same_device,
    check_tensor,
    check_weights,
    segment_offsets_with_sync,
)

_OWNER = "KeyedJaggedTensor"


class KeyedJaggedTensor(JaggedFields):
    """Sparse features of a batch: per key, B variable-length lists of ids (see the module doc).

    Args:
        keys: K feature names (a repeated key resolves to its first occurrence in lookups).
        values: ``[N]`` ids.
        weights: optional ``[N]`` float weights.
        lengths: ``[sum(stride_per_key)]`` (``[K * B]`` without variable batch), int32 / int64.
        offsets: ``[len(lengths) + 1]``; either of lengths / offsets suffices.
        stride: batch size B; inferred from the lengths and K when omitted (0 with no keys).
        stride_per_key_per_rank: K lists, each the batch size contributed by each rank to that key;
            given, the tensor has a variable batch size per feature.
        length_per_key, offset_per_key: cached per-key totals (K and K + 1 ints) if the caller has them.
        inverse_indices: ``(keys, [K, B] int64)`` for a variable batch size: row of each sample per key.
        validate: check the contents of lengths / offsets (one host sync, which also fills the
            per-key cache). Shape, dtype and device checks always run.
    """

    def __init__(
        self,
        keys: List[str],
        values: torch.Tensor,
        weights: Optional[torch.Tensor] = None,
        lengths: Optional[torch.Tensor] = None,
        offsets: Optional[torch.Tensor] = None,
        stride: Optional[int] = None,
        stride_per_key_per_rank: Optional[List[List[int]]] = None,
        length_per_key: Optional[List[int]] = None,
        offset_per_key: Optional[List[int]] = None,
        inverse_indices: Optional[InverseIndices] = None,
        *,
        validate: bool = True,
    ) -> None:
        keys = list(keys)
        check_tensor(_OWNER, "values", values)
        if values.dim() == 0:
            raise ValueError(f"{_OWNER}: values must be [N] ids or [N, D] rows, got a scalar")
        lengths, offsets = as_lengths_and_offsets(_OWNER, values, lengths, offsets)
        rows = check_lengths_offsets_sizes(_OWNER, lengths, offsets)
        check_weights(_OWNER, values, weights)
        check_same_device(_OWNER, values, weights=weights, lengths=lengths, offsets=offsets)
        self._keys = keys
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        self._stride, self._stride_per_key_per_rank = resolve_stride(
            keys, rows, stride, stride_per_key_per_rank
        )
        self._stride_per_key = (
            [sum(s) for s in self._stride_per_key_per_rank]
            if self._stride_per_key_per_rank is not None
            else [self._stride] * len(keys)
        )
        # row index where each key's lengths start: Python ints, so slicing lengths never syncs
        self._row_bounds = [0, *accumulate(self._stride_per_key)]
        if self._row_bounds[-1] != rows:
            raise ValueError(rows_mismatch(keys, self._stride_per_key, self._stride, rows))
        self._inverse_indices = checked_inverse_indices(inverse_indices, keys, values.device)
        self._offset_per_key = cached_offsets(keys, values.size(0), length_per_key, offset_per_key)
        self._index_per_key: Optional[Dict[str, int]] = None
        self._jt_dict: Optional[Dict[str, JaggedTensor]] = None
        if validate:
            checked = segment_offsets_with_sync(
                _OWNER, lengths, offsets, self._row_bounds, values.size(0), keys, True, self._inverse_checks()
            )
            if self._offset_per_key is not None and self._offset_per_key != checked:
                raise ValueError(
                    f"{_OWNER}: offset_per_key / length_per_key {self._offset_per_key} disagree with "
                    f"the lengths, which give {checked}"
                )
            self._offset_per_key = checked
        self._drop_unused_tail()

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def _trusted(
        cls,
        keys: List[str],
        values: torch.Tensor,
        weights: Optional[torch.Tensor],
        lengths: torch.Tensor,
        stride: int,
        length_per_key: Optional[List[int]] = None,
    ) -> KeyedJaggedTensor:
        """The KJT ``KeyedJaggedTensor(keys, values, weights, lengths=lengths, stride=stride,
        length_per_key=length_per_key, validate=False)`` builds, without its argument checks: for the
        library's own per-step KJTs (a key permutation's, a KJT all-to-all's output), whose tensors
        come out of its kernels already of the right kinds, where the checks cost ~15 us a KJT.

        The caller guarantees what the checks would: ``keys`` a list it hands over (kept, not
        copied), ``values`` ``[N]`` or ``[N, D]``, ``weights`` None or float ``[N]``, ``lengths`` an
        integer ``[len(keys) * stride]`` tensor, all on one device, ``length_per_key`` (host ints)
        None or summing to at most ``N``. Only the row count is checked (an int comparison).
        """
        kjt = cls.__new__(cls)
        kjt._keys = keys
        kjt._values = values
        kjt._weights = weights
        kjt._lengths = lengths
        kjt._offsets = None
        kjt._stride, kjt._stride_per_key_per_rank = stride, None
        kjt._stride_per_key = [stride] * len(keys)
        kjt._row_bounds = [0, *accumulate(kjt._stride_per_key)]
        if kjt._row_bounds[-1] != lengths.size(0):
            raise ValueError(rows_mismatch(keys, kjt._stride_per_key, stride, lengths.size(0)))
        kjt._inverse_indices = None
        kjt._offset_per_key = None if length_per_key is None else [0, *accumulate(length_per_key)]
        kjt._index_per_key = None
        kjt._jt_dict = None
        kjt._drop_unused_tail()
        return kjt

    @staticmethod
    def from_lengths_sync(
        keys: List[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: Optional[torch.Tensor] = None,
        stride: Optional[int] = None,
        stride_per_key_per_rank: Optional[List[List[int]]] = None,
        inverse_indices: Optional[InverseIndices] = None,
        *,
        validate: bool = True,
    ) -> KeyedJaggedTensor:
        """Construct and compute the per-key totals now: one host sync, shared with validation."""
        return KeyedJaggedTensor(
            keys,
            values,
            weights,
            lengths=lengths,
            stride=stride,
            stride_per_key_per_rank=stride_per_key_per_rank,
            inverse_indices=inverse_indices,
            validate=validate,
        ).sync()

    @staticmethod
    def from_offsets_sync(
        keys: List[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: Optional[torch.Tensor] = None,
        stride: Optional[int] = None,
        stride_per_key_per_rank: Optional[List[List[int]]] = None,
        inverse_indices: Optional[InverseIndices] = None,
        *,
        validate: bool = True,
    ) -> KeyedJaggedTensor:
        """Like :meth:`from_lengths_sync` from offsets ``[rows + 1]``."""
        return KeyedJaggedTensor(
            keys,
            values,
            weights,
            offsets=offsets,
            stride=stride,
            stride_per_key_per_rank=stride_per_key_per_rank,
            inverse_indices=inverse_indices,
            validate=validate,
        ).sync()

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: Optional[torch.device] = None,
        values_dtype: Optional[torch.dtype] = None,
        weights_dtype: Optional[torch.dtype] = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> KeyedJaggedTensor:
        """No keys, stride 0, empty tensors."""
        values = torch.empty(0, dtype=values_dtype or torch.long, device=device)
        weights = torch.empty(0, dtype=weights_dtype or torch.float, device=device) if is_weighted else None
        lengths = torch.empty(0, dtype=lengths_dtype, device=device)
        return KeyedJaggedTensor([], values, weights, lengths, stride=0, length_per_key=[], validate=False)

    @staticmethod
    def empty_like(kjt: KeyedJaggedTensor, device: Optional[torch.device] = None) -> KeyedJaggedTensor:
        """As torchrec: without ``device``, no keys and no values but ``kjt``'s stride (its
        ``stride_per_key_per_rank`` with a variable batch) and dtypes; with ``device``, ``kjt``'s keys
        and metadata over uninitialized tensors of the same shapes on ``device`` (``torch.empty_like``)."""
        weights, variable = kjt.weights_or_none(), kjt.variable_stride_per_key()
        if device is None:
            return KeyedJaggedTensor(
                [],
                kjt.values().new_empty(0),
                None if weights is None else weights.new_empty(0),
                lengths=kjt.lengths().new_empty(0),
                stride=None if variable else kjt.stride(),
                stride_per_key_per_rank=kjt.stride_per_key_per_rank() if variable else None,
                validate=False,
            )

        def like(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if tensor is None else torch.empty_like(tensor, device=device)

        inverse = kjt.inverse_indices_or_none()
        return KeyedJaggedTensor(
            kjt.keys(),
            like(kjt.values()),
            like(weights),
            lengths=like(kjt.lengths_or_none()),
            offsets=like(kjt.offsets_or_none()),
            stride=None if variable else kjt.stride(),
            stride_per_key_per_rank=kjt.stride_per_key_per_rank() if variable else None,
            offset_per_key=kjt.offset_per_key_or_none(),
            inverse_indices=None if inverse is None else (inverse[0], like(inverse[1])),
            validate=False,
        )

    @staticmethod
    def from_jt_dict(jt_dict: Dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        """One key per entry (in dict order). Row counts that differ give a variable batch per key.

        No host sync: the per-key totals are the JaggedTensors' sizes.
        """
        if not jt_dict:
            raise ValueError(f"{_OWNER}.from_jt_dict needs at least one JaggedTensor; use empty()")
        keys = list(jt_dict)
        jts = list(jt_dict.values())
        weighted = [jt.weights_or_none() is not None for jt in jts]
        if any(weighted) and not all(weighted):
            unweighted = [k for k, w in zip(keys, weighted) if not w]
            raise ValueError(
                f"{_OWNER}.from_jt_dict: some features are weighted, these are not: {unweighted}"
            )
        rows = [jt.lengths().numel() for jt in jts]
        uniform = len(set(rows)) == 1
        return KeyedJaggedTensor(
            keys,
            torch.cat([jt.values() for jt in jts]),
            torch.cat([jt.weights() for jt in jts]) if all(weighted) else None,
            lengths=torch.cat([jt.lengths() for jt in jts]),
            stride=rows[0] if uniform else None,
            stride_per_key_per_rank=None if uniform else [[n] for n in rows],
            length_per_key=[jt.values().size(0) for jt in jts],
            validate=False,
        )

    @staticmethod
    def concat(kjt_list: List[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """Keys of all inputs, in order; all must share the stride (or have variable batch sizes) and
        weightedness. No host sync (per-key totals are carried over when every input has them)."""
        if not kjt_list:
            raise ValueError(f"{_OWNER}.concat needs at least one KeyedJaggedTensor")
        if len(kjt_list) == 1:
            return kjt_list[0]
        weighted = {kjt.weights_or_none() is not None for kjt in kjt_list}
        if len(weighted) > 1:
            raise ValueError(f"{_OWNER}.concat: cannot mix weighted and unweighted KeyedJaggedTensors")
        variable = any(kjt.variable_stride_per_key() for kjt in kjt_list)
        strides = [kjt.stride() for kjt in kjt_list]
        if not variable and len(set(strides)) > 1:
            raise ValueError(f"{_OWNER}.concat: strides differ: {strides}")
        with_inverse = [kjt.inverse_indices_or_none() is not None for kjt in kjt_list]
        if any(with_inverse) and not all(with_inverse):
            raise ValueError(f"{_OWNER}.concat: only some inputs have inverse_indices: {with_inverse}")
        per_key = [kjt.length_per_key_or_none() for kjt in kjt_list]
        inverse = None
        if all(with_inverse):
            parts = [kjt.inverse_indices() for kjt in kjt_list]
            batches = [table.size(1) for _, table in parts]
            if len(set(batches)) > 1:
                raise ValueError(f"{_OWNER}.concat: inverse_indices cover different batches: {batches}")
            inverse = ([k for keys, _ in parts for k in keys], torch.cat([t for _, t in parts]))
        return KeyedJaggedTensor(
            [k for kjt in kjt_list for k in kjt.keys()],
            torch.cat([kjt.values() for kjt in kjt_list]),
            torch.cat([kjt.weights() for kjt in kjt_list]) if weighted == {True} else None,
            lengths=torch.cat([kjt.lengths() for kjt in kjt_list]),
            stride=max(strides) if variable else strides[0],
            stride_per_key_per_rank=(
                [s for kjt in kjt_list for s in kjt.stride_per_key_per_rank()] if variable else None
            ),
            length_per_key=[n for lpk in per_key for n in lpk]
            if all(p is not None for p in per_key)
            else None,
            inverse_indices=inverse,
            validate=False,
        )

    # ---- accessors ----------------------------------------------------------------------------

    def keys(self) -> List[str]:
        return self._keys

    def stride(self) -> int:
        """Batch size B (with a variable batch per key: the largest per-key batch, as in torchrec)."""
        return self._stride

    def stride_per_key(self) -> List[int]:
        """Number of rows (samples) of each key."""
        return self._stride_per_key

    def stride_per_key_per_rank(self) -> List[List[int]]:
        """Per key, the rows contributed by each rank; ``[]`` without a variable batch (as torchrec 1.8)."""
        if self._stride_per_key_per_rank is None:
            return []
        return self._stride_per_key_per_rank

    def variable_stride_per_key(self) -> bool:
        return self._stride_per_key_per_rank is not None

    def inverse_indices(self) -> InverseIndices:
        if self._inverse_indices is None:
            raise ValueError(f"{_OWNER} has no inverse_indices; use inverse_indices_or_none()")
        return self._inverse_indices

    def inverse_indices_or_none(self) -> Optional[InverseIndices]:
        return self._inverse_indices

    def index_per_key(self) -> Dict[str, int]:
        """Key -> position (first occurrence)."""
        if self._index_per_key is None:
            index: Dict[str, int] = {}
            for i, key in enumerate(self._keys):
                index.setdefault(key, i)
            self._index_per_key = index
        return self._index_per_key

    def offset_per_key(self) -> List[int]:
        """K + 1 value offsets where each key starts; one host sync the first time, then cached."""
        if self._offset_per_key is None:
            self._offset_per_key = segment_offsets_with_sync(
                _OWNER,
                self._lengths,
                self._offsets,
                self._row_bounds,
                self._values.size(0),
                self._keys,
                False,
            )
            self._drop_unused_tail()
        return self._offset_per_key

    def offset_per_key_or_none(self) -> Optional[List[int]]:
        return self._offset_per_key

    def length_per_key(self) -> List[int]:
        """Number of values of each key; one host sync the first time, then cached."""
        offsets = self.offset_per_key()
        return list(map(operator.sub, offsets[1:], offsets[:-1]))  # C speed: called per step and key

    def length_per_key_or_none(self) -> Optional[List[int]]:
        return None if self._offset_per_key is None else self.length_per_key()

    def sync(self) -> KeyedJaggedTensor:
        """Compute the per-key totals now (one host sync unless cached); returns self."""
        self.offset_per_key()
        return self

    def unsync(self) -> KeyedJaggedTensor:
        """Drop the cached per-key totals (and the to_dict cache); returns self."""
        self._offset_per_key = None
        self._jt_dict = None
        return self

    # ---- operations ---------------------------------------------------------------------------

    def __getitem__(self, key: str) -> JaggedTensor:
        """The JaggedTensor of ``key`` (views); KeyError listing the known keys if absent."""
        index = self.index_per_key().get(key)
        if index is None:
            raise unknown_key_error(_OWNER, key, self._keys)
        return self._jagged(index)

    def to_dict(self) -> Dict[str, JaggedTensor]:
        """Key -> JaggedTensor of views into this tensor (cached)."""
        if self._jt_dict is None:
            self._jt_dict = {key: self._jagged(i) for key, i in self.index_per_key().items()}
        return self._jt_dict

    def split(self, segments: List[int]) -> List[KeyedJaggedTensor]:
        """Consecutive groups of ``segments[i]`` keys; the results are views (no copy)."""
        if any(s < 0 for s in segments) or sum(segments) != len(self._keys):
            raise ValueError(
                f"{_OWNER}.split: segments {segments} must be >= 0 and sum to {len(self._keys)} keys"
            )
        offsets = self.offset_per_key()
        bounds = [0, *accumulate(segments)]
        trusted = self._stride_per_key_per_rank is None and self._inverse_indices is None
        if trusted and not torch.compiler.is_compiling():
            # one batch size, no inverse indices (a sharded lookup splits every step's input by its
            # groups): the parts are this KJT's checked views, built without the checks (~8 us a part).
            # Not under torch.compile / export: exporting a weighted collection through it failed on a
            # data-dependent guard (the weights' size against the ids'; tests/modules/test_export.py)
            lengths, weights, stride = self.lengths(), self._weights, self._stride
            return [
                KeyedJaggedTensor._trusted(
                    self._keys[start:end],
                    self._values[offsets[start] : offsets[end]],
                    None if weights is None else weights[offsets[start] : offsets[end]],
                    lengths[start * stride : end * stride],
                    stride,
                    list(map(operator.sub, offsets[start + 1 : end + 1], offsets[start:end])),
                )
                for start, end in zip(bounds, bounds[1:])
            ]
        out = []
        for start, end in zip(bounds, bounds[1:]):
            values = slice(offsets[start], offsets[end])
            rows = slice(self._row_bounds[start], self._row_bounds[end])
            out.append(
                KeyedJaggedTensor(
                    self._keys[start:end],
                    self._values[values],
                    None if self._weights is None else self._weights[values],
                    lengths=self.lengths()[rows],
                    stride=self._stride,
                    stride_per_key_per_rank=self._slice_strides(start, end),
                    offset_per_key=[o - offsets[start] for o in offsets[start : end + 1]],
                    inverse_indices=self._slice_inverse(list(range(start, end))),
                    validate=False,
                )
            )
        return out

    def permute(self, indices: List[int], indices_tensor: Optional[torch.Tensor] = None) -> KeyedJaggedTensor:
        """Keys reordered (or repeated, or dropped) as ``keys[indices[0]], keys[indices[1]], ...``.

        Copies the values once (one concatenation per tensor). ``indices_tensor`` is accepted for
        torchrec compatibility and unused: the gather is driven by host-side offsets.
        """
        del indices_tensor
        num_keys = len(self._keys)
        bad = [i for i in indices if not 0 <= i < num_keys]
        if bad:
            raise IndexError(f"{_OWNER}.permute: indices {bad} out of range for {num_keys} keys {self._keys}")
        lengths = self.length_per_key()
        return KeyedJaggedTensor(
            [self._keys[i] for i in indices],
            take_segments(self._values, lengths, indices),
            None if self._weights is None else take_segments(self._weights, lengths, indices),
            lengths=take_segments(self.lengths(), self._stride_per_key, indices),
            stride=self._stride,
            stride_per_key_per_rank=(
                None
                if self._stride_per_key_per_rank is None
                else [self._stride_per_key_per_rank[i] for i in indices]
            ),
            length_per_key=[lengths[i] for i in indices],
            inverse_indices=self._slice_inverse(indices),
            validate=False,
        )

    # ---- device movement ----------------------------------------------------------------------

    def to(
        self, device: torch.device, non_blocking: bool = False, dtype: Optional[torch.dtype] = None
    ) -> KeyedJaggedTensor:
        """A copy on ``device``; ``dtype`` (if given) converts the weights. Caches are kept.

        Already there (and no ``dtype``): ``self``, as ``torch.Tensor.to`` returns the tensor itself,
        so that a pipeline's per-batch move of a CPU batch to the CPU builds nothing."""
        if dtype is None and self._on(device):
            return self

        def move(tensor: torch.Tensor, convert: bool = False) -> torch.Tensor:
            return tensor.to(device, dtype=dtype if convert else None, non_blocking=non_blocking)

        return self._map(move)

    def pin_memory(self) -> KeyedJaggedTensor:
        """A copy in page-locked host memory, for asynchronous host-to-device copies (needs CUDA)."""
        return self._map(lambda tensor, convert=False: tensor.pin_memory())

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark every tensor as used by ``stream`` so the caching allocator does not reuse it early."""
        tensors = [self._values, self._weights, self._lengths, self._offsets]
        if self._inverse_indices is not None:
            tensors.append(self._inverse_indices[1])
        for tensor in tensors:
            if tensor is not None:
                tensor.record_stream(stream)

    # ---- internals ----------------------------------------------------------------------------

    def _on(self, device) -> bool:
        """Whether every tensor is on ``device`` exactly (``torch.device`` equality: "cuda" is not
        "cuda:0", so an unindexed device counts as elsewhere and gets the copy path)."""
        device = torch.device(device) if not isinstance(device, torch.device) else device
        tensors = (self._values, self._weights, self._lengths, self._offsets)
        if self._inverse_indices is not None:
            tensors = (*tensors, self._inverse_indices[1])
        return all(t is None or t.device == device for t in tensors)

    def _drop_unused_tail(self) -> None:
        """Values past the last key's end belong to no key (torchrec ignores them): drop them (views)
        once the per-key offsets are known, so that every consumer of ``values()`` sees only real ones."""
        # guard_or_false: under torch.export the per-key offsets can be unbacked symbols, and a tail
        # that cannot be proven present is taken as absent (the exported program expects none)
        end = self._offset_per_key[-1] if self._offset_per_key is not None else None
        if end is not None and guard_or_false(end < self._values.size(0)):
            self._values = self._values[:end]
            self._weights = None if self._weights is None else self._weights[:end]

    def _jagged(self, index: int) -> JaggedTensor:
        offsets = self.offset_per_key()
        values = slice(offsets[index], offsets[index + 1])
        rows = slice(self._row_bounds[index], self._row_bounds[index + 1])
        return JaggedTensor(
            self._values[values],
            None if self._weights is None else self._weights[values],
            lengths=self.lengths()[rows],
            validate=False,
        )

    def _inverse_checks(self) -> List[Tuple[torch.Tensor, str]]:
        if self._inverse_indices is None or not self._keys:
            return []
        table = self._inverse_indices[1]
        limit = host_list_to_device(self._stride_per_key, table.device).unsqueeze(1)
        failed = ((table < 0) | (table >= limit)).any()
        return [(failed, f"inverse_indices must lie in [0, stride_per_key) = {self._stride_per_key} per key")]

    def _slice_strides(self, start: int, end: int) -> Optional[List[List[int]]]:
        if self._stride_per_key_per_rank is None:
            return None
        return self._stride_per_key_per_rank[start:end]

    def _slice_inverse(self, indices: List[int]) -> Optional[InverseIndices]:
        # inverse_indices has one row per key of this tensor, so it follows the keys around
        if self._inverse_indices is None:
            return None
        keys, table = self._inverse_indices
        index = host_list_to_device(indices, table.device)
        return [keys[i] for i in indices], table.index_select(0, index)

    def _map(self, fn) -> KeyedJaggedTensor:
        def apply(tensor: Optional[torch.Tensor], convert: bool = False) -> Optional[torch.Tensor]:
            return None if tensor is None else fn(tensor, convert)

        inverse = None
        if self._inverse_indices is not None:
            inverse = (self._inverse_indices[0], fn(self._inverse_indices[1]))
        return KeyedJaggedTensor(
            self._keys,
            fn(self._values),
            apply(self._weights, True),
            lengths=apply(self._lengths),
            offsets=apply(self._offsets),
            stride=self._stride,
            stride_per_key_per_rank=self._stride_per_key_per_rank,
            offset_per_key=self._offset_per_key,
            inverse_indices=inverse,
            validate=False,
        )

    def __str__(self) -> str:
        """Every key's rows (and weights), in torchrec's format; reads them back to the host."""
        if not self._keys:
            return "KeyedJaggedTensor()\n"
        return keyed_jagged_tensor_string(
            self._keys, self._values, self._weights, self.offsets(), self._row_bounds
        )

    def __repr__(self) -> str:
        weighted = ", weighted" if self._weights is not None else ""
        variable = f", stride_per_key={self._stride_per_key}" if self.variable_stride_per_key() else ""
        return (
            f"KeyedJaggedTensor(keys={self._keys}, stride={self._stride}{variable}, "
            f"values={self._values.numel()}{weighted})"
        )
