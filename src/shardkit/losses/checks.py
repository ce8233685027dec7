"""Input validation for the vocab-parallel losses: local checks, then one cross-rank agreement check.

Every loss validates before its first data collective:

1. Local checks (types, shapes, devices, this rank's ``[start, end)`` against its shard width, option
   values) always run; they cost nothing.
2. With ``shardkit.distributed.validation`` on (the default; ``set_validation(False)`` or
   ``SHARDKIT_VALIDATE=0`` turns it off) and more than one rank, the ranks exchange a fixed-size int64
   descriptor of their call in one all-gather (which cannot itself mismatch): whether the local checks
   failed, the vocabulary slice, the token count, a digest of the options and of the targets, and the
   targets' min / max. Every rank reaches the same verdict from the same data, so a bad input on one
   rank, or ranks that disagree, raise on every rank and no rank is left waiting in the loss's
   collective. Reading the descriptor is the host sync the switch exists for.
3. Target ids outside ``[0, V)`` that are not the ignore index raise ``TargetOutOfRangeError`` (an
   ``IndexError`` and a ``ValueError``) naming the ids and their positions, when validation is on.

With validation off, a local problem raises on its own rank before any collective, out-of-range ids
are not detected (they are clamped when gathered, so memory is never read out of bounds, but the loss
of such a token is meaningless), and the ranks are trusted to agree.
"""

from __future__ import annotations

import zlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import (
    DTYPE_CODES,
    all_gather_flat,
    format_per_rank,
    group_rank,
    group_size,
)
from shardkit.distributed.validation import validation_enabled

_INT64_MAX = torch.iinfo(torch.int64).max
_INT64_MIN = torch.iinfo(torch.int64).min
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# descriptor fields exchanged between ranks
_DTYPE_NAMES = {code: str(dtype).replace("torch.", "") for dtype, code in DTYPE_CODES.items()}
_PROBLEM, _START, _END, _TOKENS, _OPTIONS, _VOCAB, _DTYPE, _TMIN, _TMAX, _TDIGEST = range(10)
_MAX_LISTED_IDS = 5


class TargetOutOfRangeError(IndexError, ValueError):
    """Target ids outside ``[0, V)`` that are not the ignore index (both an IndexError and a ValueError)."""


def group_rank_and_size(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    size = group_size(group)
    if size < 1:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of the given process group")
    return group_rank(group), size


def local_problems(
    logits: torch.Tensor,
    target: Optional[torch.Tensor],
    start: int,
    end: int,
    vocab_size: Optional[int],
    logits_name: str = "logits",
) -> list[str]:
    """What is wrong with this rank's arguments, as messages (empty when nothing is)."""
    problems = []
    if not isinstance(logits, torch.Tensor):
        return [f"{logits_name} must be a tensor, got {type(logits).__name__}"]
    if logits.dtype not in _FLOAT_DTYPES:
        problems.append(f"{logits_name} must be floating point, got {logits.dtype}")
    if logits.dim() < 1:
        return problems + [f"{logits_name} must have a vocabulary dimension, got a 0-d tensor"]
    width = logits.size(-1)
    if start < 0 or end - start != width:
        problems.append(
            f"vocabulary slice [{start}, {end}) has {end - start} columns but the {logits_name} shard "
            f"{tuple(logits.shape)} has {width}"
        )
    if vocab_size is not None and vocab_size < 1:
        problems.append(f"vocab_size must be >= 1, got {vocab_size}")
    if target is not None:
        if not isinstance(target, torch.Tensor):
            problems.append(f"target must be a tensor, got {type(target).__name__}")
        elif target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
            problems.append(f"target must hold integer token ids, got {target.dtype}")
        elif tuple(target.shape) != tuple(logits.shape[:-1]):
            problems.append(
                f"target shape {tuple(target.shape)} does not match {logits_name} shape "
                f"{tuple(logits.shape)} without its last (vocabulary) dimension"
            )
        elif target.device != logits.device and logits.device.type != "meta":
            problems.append(f"target is on {target.device} but {logits_name} on {logits.device}")
    return problems


def options_digest(options: Sequence) -> int:
    """A process-independent digest of option values (``hash`` of a str is salted per process)."""
    return zlib.crc32(repr(tuple(options)).encode()) & 0x7FFFFFFF


def _valid_mask(target: torch.Tensor, ignore_index: Optional[int]) -> torch.Tensor:
    if ignore_index is None:
        return torch.ones_like(target, dtype=torch.bool)
    return target != ignore_index


def _target_summary(target: torch.Tensor, ignore_index: Optional[int]) -> torch.Tensor:
    """``[min, max, digest]`` of the non-ignored ids (int64, on the target's device, no host sync)."""
    t = target.reshape(-1).to(torch.int64)
    valid = _valid_mask(t, ignore_index)
    big = torch.full((1,), _INT64_MAX, dtype=torch.int64, device=t.device)
    small = torch.full((1,), _INT64_MIN, dtype=torch.int64, device=t.device)
    low = torch.cat([torch.where(valid, t, big), big]).min()
    high = torch.cat([torch.where(valid, t, small), small]).max()
    # position weights make the digest sensitive to order, not only to the multiset of ids
    weights = torch.arange(t.numel(), device=t.device, dtype=torch.int64) % 9973 + 1
    digest = (t * weights).sum()
    return torch.stack([low, high, digest])


def out_of_range_message(
    op: str, target: torch.Tensor, ignore_index: Optional[int], vocab: int
) -> Optional[str]:
    """The error for ids outside ``[0, vocab)`` (not counting ``ignore_index``), or None. Host sync."""
    t = target.reshape(-1).to(torch.int64)
    bad = _valid_mask(t, ignore_index) & ((t < 0) | (t >= vocab))
    positions = bad.nonzero().flatten()
    if positions.numel() == 0:
        return None
    shown = positions[:_MAX_LISTED_IDS].tolist()
    shape = tuple(target.shape)
    listed = ", ".join(
        f"id {t[p].item()} at position {tuple(int(i) for i in _unravel(p, shape))}" for p in shown
    )
    ignore = "" if ignore_index is None else f" and are not ignore_index {ignore_index}"
    return (
        f"{op}: {positions.numel()} target ids are outside the vocabulary [0, {vocab}){ignore}: {listed}"
        + (" ..." if positions.numel() > len(shown) else "")
    )


def _unravel(flat: int, shape: tuple) -> list[int]:
    index = []
    for size in reversed(shape):
        index.append(flat % size if size else 0)
        flat //= max(size, 1)
    return list(reversed(index)) or [flat]


def validate_call(
    op: str,
    group: Optional[dist.ProcessGroup],
    logits: torch.Tensor,
    target: Optional[torch.Tensor],
    start: int,
    end: int,
    *,
    vocab_size: Optional[int] = None,
    ignore_index: Optional[int] = None,
    options: Sequence = (),
    problems: Sequence[str] = (),
    logits_name: str = "logits",
    check_slices: bool = True,
    device: Optional[torch.device] = None,
) -> None:
    """Validate one loss call on every rank of ``group`` (module doc); raises before any data collective.

    ``problems`` are extra local messages from the caller (bad option values). ``vocab_size`` is the
    real vocabulary size when the vocabulary is padded (None: every column is real). ``check_slices``
    False skips the check that the slices tile the vocabulary (for operations that need no offsets).
    ``device``: where the descriptor goes when ``logits`` is a ``meta`` stand-in (fused linear loss).
    """
    rank, tp = group_rank_and_size(group)
    problems = list(problems) + local_problems(logits, target, start, end, vocab_size, logits_name)
    if tp == 1 or not validation_enabled():
        if tp == 1 and not problems and start != 0 and check_slices:
            problems.append(f"a single rank must hold the whole vocabulary, but its slice starts at {start}")
        if problems:
            raise ValueError(f"{op} on rank {rank}: " + "; ".join(problems))
        if tp == 1 and validation_enabled():
            _check_vocab_size(op, vocab_size, end)
            _raise_out_of_range(op, target, ignore_index, vocab_size or end)
        return
    if device is None:
        device = logits.device if isinstance(logits, torch.Tensor) else torch.device("cpu")
    ntok = logits.numel() // max(1, logits.size(-1)) if not problems else -1
    head = torch.tensor(
        [
            int(bool(problems)),
            start,
            end,
            ntok,
            options_digest(options),
            -1 if vocab_size is None else vocab_size,
            # ranks with different logits dtypes would exchange buffers of different byte sizes
            DTYPE_CODES.get(logits.dtype, -1) if isinstance(logits, torch.Tensor) else -1,
        ],
        dtype=torch.int64,
        device=device,
    )
    if problems or target is None:
        tail = torch.zeros(3, dtype=torch.int64, device=device)
    else:
        tail = _target_summary(target, ignore_index)
    desc = torch.cat([head, tail])
    out = torch.empty(tp * desc.numel(), dtype=torch.int64, device=device)
    all_gather_flat(out, desc, group=group)
    rows = out.view(tp, desc.numel()).tolist()
    failed = [r for r, row in enumerate(rows) if row[_PROBLEM]]
    if failed:
        if problems:
            raise ValueError(f"{op} on rank {rank}: " + "; ".join(problems))
        raise ValueError(
            f"{op}: rank(s) {failed} passed invalid input (their error names the problem); "
            "no rank entered the loss's collective"
        )
    fields = ((_TOKENS, "number of tokens"), (_OPTIONS, "options"), (_VOCAB, "vocab_size"), (_DTYPE, "dtype"))
    for field, what in fields:
        values = [row[field] for row in rows]
        if field == _DTYPE:
            values = [_DTYPE_NAMES.get(v, "another dtype") for v in values]
        if any(v != values[0] for v in values[1:]):
            raise ValueError(f"{op}: ranks disagree on the {what}: {format_per_rank(values)}")
    if target is not None:
        digests = [tuple(row[_TMIN:]) for row in rows]
        if any(d != digests[0] for d in digests[1:]):
            raise ValueError(
                f"{op}: ranks passed different targets (the targets must be the same on every rank of "
                f"the tensor-parallel group); (min, max, digest) per rank: {format_per_rank(digests)}"
            )
    slices = [(row[_START], row[_END]) for row in rows]
    if not check_slices:
        return
    vocab = _check_tiling(op, slices)
    _check_vocab_size(op, vocab_size, vocab)
    real = vocab_size or vocab
    if (
        target is not None
        and (rows[0][_TMIN] < 0 or rows[0][_TMAX] >= real)
        and rows[0][_TMIN] <= rows[0][_TMAX]
    ):
        # every rank holds the same targets (checked above), so every rank finds the same ids
        _raise_out_of_range(op, target, ignore_index, real)


def _check_tiling(op: str, slices: list[tuple[int, int]]) -> int:
    """The padded vocabulary size, after checking that the ranks' slices tile ``[0, V)`` exactly."""
    position = 0
    for start, end in sorted(slices):
        if start != position:
            raise ValueError(
                f"{op}: the ranks' vocabulary slices do not tile [0, V) without gaps or overlaps "
                f"(expected a slice starting at {position}): {format_per_rank(slices)}"
            )
        position = end
    return position


def _check_vocab_size(op: str, vocab_size: Optional[int], padded: int) -> None:
    if vocab_size is not None and vocab_size > padded:
        raise ValueError(f"{op}: vocab_size {vocab_size} exceeds the {padded} columns of the sharded logits")


def _raise_out_of_range(
    op: str, target: Optional[torch.Tensor], ignore_index: Optional[int], vocab: int
) -> None:
    if target is None:
        return
    message = out_of_range_message(op, target, ignore_index, vocab)
    if message is not None:
        raise TargetOutOfRangeError(message)


REDUCTIONS = ("none", "sum", "mean")


def option_problems(
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
    reduction: str = "none",
    chunk_size: Optional[int] = None,
) -> list[str]:
    """Messages for option values that are out of range (empty when all are fine)."""
    problems = []
    if not 0.0 <= label_smoothing <= 1.0:
        problems.append(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not z_loss >= 0.0:
        problems.append(f"z_loss must be >= 0, got {z_loss}")
    if softcap is not None and not softcap > 0.0:
        problems.append(f"softcap must be > 0 or None, got {softcap}")
    if not temperature > 0.0:
        problems.append(f"temperature must be > 0, got {temperature}")
    if reduction not in REDUCTIONS:
        # the message starts as NeMo Automodel's tests expect
        problems.append(f"Invalid reduction: {reduction!r} (must be one of {REDUCTIONS})")
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size >= 1):
        problems.append(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    return problems


def either_group(op: str, group, tp_group):
    """The group passed as shardkit's ``group`` or as NeMo RL's / Megatron's ``tp_group`` (not both)."""
    if group is not None and tp_group is not None:
        raise TypeError(f"{op}: pass the tensor-parallel group as group= or tp_group=, not both")
    return group if group is not None else tp_group
