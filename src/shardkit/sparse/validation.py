"""Input checks shared by the jagged types, and the rule for which of them cost a host sync.

Checks on metadata (dtypes, devices, ``numel`` of each tensor, number of keys) are free and always run.
Checks on tensor *contents* (lengths non-negative, lengths summing to the number of values, offsets
consistent with lengths) need the device to report back to the host once. They run when a
constructor is called with ``validate=True`` (the default) and are batched into one small
``tolist()``; the per-key sums computed by that same sync are cached, so a validated
KeyedJaggedTensor answers ``length_per_key()`` / ``offset_per_key()`` without another sync.
Pass ``validate=False`` on a hot path whose inputs are known to be well formed; shardkit itself does so
for every tensor it derives from an already validated one (permute, split, to_dict, concat).

The rule for what is accepted (docs/sparse.md): what torchrec documents as valid is accepted; only what
cannot be computed correctly is rejected, with an error that says what is wrong and how to fix it.
Hence ``values`` longer than the lengths say (the tail is ignored, as torchrec), an empty
non-integer ``lengths`` (``torch.tensor([])``: it holds no length), and tensors on the meta device
(nothing to check; per-key counts are placeholders, see :func:`segment_offsets_with_sync`).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Optional, Sequence, Tuple

import torch

from shardkit.sparse.jagged_ops import complete_cumsum, host_list_to_device


def check_tensor(owner: str, name: str, tensor: torch.Tensor, integer: bool = False) -> None:
    """Type / dtype checks that need no sync."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if integer and (tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool):
        raise TypeError(f"{owner}: {name} must have an integer dtype, got {tensor.dtype}")


def is_id_dtype(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` can hold row ids (an integer dtype, not bool)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_id_dtype(owner: str, ids: torch.Tensor, features: Sequence[str]) -> None:
    """``TypeError`` naming ``features`` and the dtype unless ``ids`` (the values an embedding lookup
    reads as row ids) is an integer tensor. A KeyedJaggedTensor may carry float values, but a float id
    names no row: torch's index cast would truncate 1.5 to row 1 and -0.5 to the valid row 0."""
    if not is_id_dtype(ids.dtype):
        raise TypeError(
            f"{owner}: the ids of feature(s) {list(features)} have dtype {ids.dtype}; ids must be an "
            "integer tensor (torch.int64 or torch.int32), a float id is never rounded to a row (convert "
            "them yourself if that is meant, e.g. values.round().long())"
        )


def as_index_tensor(owner: str, name: str, tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``lengths`` / ``offsets`` checked to be integer; an empty one of another dtype becomes int32."""
    if tensor is None:
        return None
    check_tensor(owner, name, tensor)
    if tensor.numel() == 0 and (tensor.dtype.is_floating_point or tensor.dtype == torch.bool):
        return tensor.to(torch.int32)  # holds no length: its dtype carries nothing
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise TypeError(
            f"{owner}: {name} must have an integer dtype, got {tensor.dtype} (build it with an integer "
            "dtype, e.g. torch.tensor([...], dtype=torch.int32))"
        )
    return tensor


def as_lengths_and_offsets(
    owner: str, values: torch.Tensor, lengths: Optional[torch.Tensor], offsets: Optional[torch.Tensor]
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``lengths`` / ``offsets`` as index tensors, with torchrec's spellings of "no rows" accepted.

    An empty ``offsets`` (``torch.tensor([])``) means no rows, like ``[0]``; neither tensor given with
    no values (``KeyedJaggedTensor([], torch.Tensor())``) means no rows too.
    """
    lengths = as_index_tensor(owner, "lengths", lengths)
    offsets = as_index_tensor(owner, "offsets", offsets)
    if offsets is not None and offsets.numel() == 0:
        offsets = offsets.new_zeros(1)
    if lengths is None and offsets is None and values.numel() == 0:
        lengths = torch.zeros(0, dtype=torch.int32, device=values.device)
    return lengths, offsets


def check_1d(owner: str, name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 1:
        raise ValueError(f"{owner}: {name} must be 1-D, got shape {tuple(tensor.shape)}")


def check_same_device(owner: str, reference: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    for name, tensor in others.items():
        if tensor is not None and tensor.device != reference.device:
            raise ValueError(f"{owner}: {name} is on {tensor.device} but values are on {reference.device}")


def check_weights(owner: str, values: torch.Tensor, weights: Optional[torch.Tensor]) -> None:
    if weights is None:
        return
    check_tensor(owner, "weights", weights)
    check_1d(owner, "weights", weights)
    count, expected = weights.numel(), values.size(0)
    if not isinstance(count, int) or not isinstance(expected, int):
        # torch.export: the sizes are symbols (weights built per key from unbacked per-key counts);
        # a recorded runtime check instead of a guard the tracer cannot decide
        torch._check(count == expected, lambda: f"{owner}: one weight per value is required")
        return
    if count != expected:
        raise ValueError(
            f"{owner}: weights has {weights.numel()} elements but values has {values.size(0)}; "
            "there must be one weight per value"
        )


def check_lengths_offsets_sizes(
    owner: str, lengths: Optional[torch.Tensor], offsets: Optional[torch.Tensor]
) -> int:
    """Checks the shapes of lengths / offsets and returns the number of rows they describe."""
    if lengths is None and offsets is None:
        raise ValueError(f"{owner}: one of lengths or offsets is required (values are not empty)")
    if lengths is not None:
        check_1d(owner, "lengths", lengths)
    if offsets is not None:
        check_1d(owner, "offsets", offsets)
    if lengths is not None and offsets is not None and offsets.numel() != lengths.numel() + 1:
        raise ValueError(
            f"{owner}: offsets has {offsets.numel()} elements, expected lengths + 1 = {lengths.numel() + 1}"
        )
    return lengths.numel() if lengths is not None else offsets.numel() - 1


def segment_offsets_with_sync(
    owner: str,
    lengths: Optional[torch.Tensor],
    offsets: Optional[torch.Tensor],
    row_bounds: Sequence[int],
    num_values: int,
    segment_names: Optional[Sequence[str]],
    validate: bool,
    extra_checks: Sequence[Tuple[torch.Tensor, str]] = (),
) -> list[int]:
    """Value offsets at the given row boundaries (one per segment + 1), in ONE host sync.

    With ``validate`` the same sync also brings back the smallest length, the first offset and whether
    the given offsets disagree with the given lengths, and errors name the segment (feature) at fault;
    ``segment_names=None`` means one unnamed segment (a JaggedTensor). ``extra_checks`` are
    (boolean scalar tensor that is True on failure, message) pairs brought back in the same sync.
    The last offset may be below ``num_values`` (the values' tail is unused), never above.

    On the meta device nothing can be read back: the values are split evenly over the segments (the
    first ones one more), placeholders that let shapes flow through a model built on meta, as torchrec.
    """
    tensor = offsets if offsets is not None else lengths
    if tensor.device.type == "meta":
        return _even_split_offsets(len(row_bounds) - 1, num_values)
    if not validate and isinstance(num_values, int) and num_values == 0 and torch.compiler.is_compiling():
        # torch.export of an input with no values (a zero-sample batch): every offset is 0, and
        # reading them back would leave unbacked symbols that no output uses
        return [0] * len(row_bounds)
    full = offsets.long() if offsets is not None else complete_cumsum(lengths.long())
    parts = [full[host_list_to_device(row_bounds, full.device)]]
    if validate:
        derived = full[1:] - full[:-1]
        smallest = derived.min().view(1) if derived.numel() else full.new_zeros(1)
        parts += [smallest, full[:1]]
        if lengths is not None and offsets is not None:
            parts.append((derived != lengths.long()).any().long().view(1))
        parts += [failed.long().view(1) for failed, _ in extra_checks]
    stats = torch.cat(parts).tolist()
    seg = stats[: len(row_bounds)]
    if validate:
        smallest, first = stats[len(row_bounds)], stats[len(row_bounds) + 1]
        if first != 0:
            raise ValueError(f"{owner}: offsets must start at 0, got {first}")
        if smallest < 0:
            _raise_negative(owner, derived, row_bounds, segment_names, lengths is None)
        consistency = stats[len(row_bounds) + 2 : len(stats) - len(extra_checks)]
        if any(consistency):
            raise ValueError(f"{owner}: offsets are not the cumulative sum of lengths")
        failed_extra = stats[len(stats) - len(extra_checks) :] if extra_checks else []
        for failed, (_, message) in zip(failed_extra, extra_checks):
            if failed:
                raise ValueError(f"{owner}: {message}")
        if seg[-1] > num_values:
            names = segment_names or ()
            per_key = ", ".join(f"{n}={b - a}" for n, a, b in zip(names, seg, seg[1:]))
            what = "lengths sum" if lengths is not None else "offsets end"
            detail = f" (per key: {per_key})" if per_key else ""
            raise ValueError(
                f"{owner}: {what} to {seg[-1]} but values has only {num_values} elements{detail}; the "
                "lengths must not describe more values than there are"
            )
    return seg


def _even_split_offsets(num_segments: int, num_values: int) -> list[int]:
    base, extra = divmod(num_values, max(num_segments, 1))
    sizes = [base + (1 if i < extra else 0) for i in range(num_segments)]
    return [0, *accumulate(sizes)] if num_segments else [0]


def _raise_negative(
    owner: str,
    derived: torch.Tensor,
    row_bounds: Sequence[int],
    segment_names: Optional[Sequence[str]],
    from_offsets: bool,
) -> None:
    # only reached on the error path, so the extra syncs to locate the culprit cost nothing in practice
    row = int(torch.nonzero(derived < 0)[0].item())
    value = int(derived[row].item())
    what = "offsets decrease" if from_offsets else "negative length"
    if segment_names is None:
        raise ValueError(f"{owner}: {what} ({value}) at row {row}")
    segment = next(i for i in range(len(segment_names)) if row < row_bounds[i + 1])
    raise ValueError(
        f"{owner}: {what} ({value}) for feature {segment_names[segment]!r} at sample "
        f"{row - row_bounds[segment]}"
    )
