"""NeMo RL's current ``x_token.loss_utils`` additions (issue 28, item 3), by name and signature.

- ``LocalizedAlignment`` / ``localize_alignment(data, *, teacher_seq_len, alignment_prefix="alignment_",
  cp_group=None)``: the alignment fields of a data dict for this context-parallel rank: DTensors
  taken as their local tensors, ``teacher_chunk_id`` cut to this rank's contiguous window
  ``[r * teacher_seq_len, (r + 1) * teacher_seq_len)`` (``r`` the rank in ``cp_group``; 0 without a
  group or with one rank), the student fields left as they are.
- Teacher logits sharded over the teacher's own tensor / context parallelism: each shard is a dict
  ``{"payload_ipc", "buf_idx", "sample_index_in_buf", "actual_shape": (T_local, V_local),
  "vocab_start_index", "vocab_end_index", "global_seq_start", "full_seq_len", "full_vocab_size"}``.
  ``payload_ipc`` is a storage ``[N, B, T, V]`` (NeMo RL's layout): a tensor (same process) or a
  shardkit IPC handle (``TeacherLogitsBuffer.handle()``, whose ``[B, T, V]`` buffer reads as
  ``N = 1``). ``collect_overlapping_teacher_shards`` plans the copies onto this student CP rank's
  window ``[r * S // cp, (r + 1) * S // cp)``, ``assemble_teacher_logits_from_shards`` performs them
  into an fp32 ``[S / cp, V]`` tensor (zeros where no shard writes), and
  ``_try_zero_copy_teacher_logits`` returns a view of the storage instead when one full-vocabulary
  shard per sample covers the window and the samples are consecutive rows of one storage slot.
- ``slice_sparse_projection_cols(sparse_matrix, col_indices)``: ``M[:, col_indices]`` of a sparse COO
  ``[V_s, V_t]`` matrix, as a coalesced sparse ``[V_s, K]``.
- ``vocab_parallel_log_softmax``: ``shardkit.losses.vocab_parallel_log_softmax`` (NeMo RL's
  ``model_utils`` form, ``(logits, temperature, *, tp_group=None)``), re-exported.

NeMo RL's compact-shard handles (``storage_shape`` / ``token_offset``) and reusable CUDA IPC
descriptors are not supported: such a handle is a ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from shardkit.distill.ipc import _open as _open_ipc_handle
from shardkit.distributed.agreement import group_rank, group_size
from shardkit.losses.dtensor import is_dtensor
from shardkit.losses.nemo_rl_vocab import vocab_parallel_log_softmax

__all__ = [
    "LocalizedAlignment",
    "_try_zero_copy_teacher_logits",
    "assemble_teacher_logits_from_shards",
    "collect_overlapping_teacher_shards",
    "localize_alignment",
    "slice_sparse_projection_cols",
    "vocab_parallel_log_softmax",
]

ShardPlan = Tuple[Dict[str, Any], slice, slice, slice, slice]
_SHARD_KEYS = ("vocab_start_index", "vocab_end_index", "global_seq_start", "actual_shape")


def _local(value: Any) -> Any:
    return value.to_local() if is_dtensor(value) else value


def _cp_rank(cp_group: Optional[dist.ProcessGroup]) -> int:
    return group_rank(cp_group) if cp_group is not None and group_size(cp_group) > 1 else 0


@dataclass
class LocalizedAlignment:
    """A rank's alignment tensors: ``sample_mask [B]``, ``student_chunk_id [B, T_s]``,
    ``teacher_chunk_id [B, teacher_seq_len]`` (this CP rank's window), ``pair_valid`` /
    ``pair_is_correct [B, C]``; ``student_input_ids`` / ``student_token_mask`` for callers to fill."""

    sample_mask: torch.Tensor
    student_chunk_id: Optional[torch.Tensor] = None
    teacher_chunk_id: Optional[torch.Tensor] = None
    pair_valid: Optional[torch.Tensor] = None
    pair_is_correct: Optional[torch.Tensor] = None
    student_input_ids: Optional[torch.Tensor] = None
    student_token_mask: Optional[torch.Tensor] = None


def localize_alignment(
    data: Mapping[str, Any],
    *,
    teacher_seq_len: int,
    alignment_prefix: str = "alignment_",
    cp_group: Optional[dist.ProcessGroup] = None,
) -> LocalizedAlignment:
    """This CP rank's alignment fields of ``data`` (see the module doc).

    Reads ``sample_mask`` (unprefixed) and ``{alignment_prefix}student_chunk_id``,
    ``teacher_chunk_id``, ``pair_valid``, ``pair_is_correct``. Raises ``KeyError`` naming every
    missing key, ``ValueError`` when the teacher window lies beyond ``teacher_chunk_id``.
    """
    names = ["student_chunk_id", "teacher_chunk_id", "pair_valid", "pair_is_correct"]
    keys = ["sample_mask"] + [alignment_prefix + n for n in names]
    missing = [k for k in keys if k not in data]
    if missing:
        raise KeyError(f"localize_alignment: the data dict lacks {missing}")
    length = int(teacher_seq_len)
    if length < 0:
        raise ValueError(f"localize_alignment: teacher_seq_len must be >= 0, got {teacher_seq_len}")
    rank = _cp_rank(cp_group)
    teacher = _local(data[alignment_prefix + "teacher_chunk_id"])
    start = rank * length
    if start + length > teacher.size(1):
        raise ValueError(
            f"localize_alignment: CP rank {rank}'s teacher window [{start}, {start + length}) lies beyond "
            f"{alignment_prefix}teacher_chunk_id of width {teacher.size(1)}"
        )
    return LocalizedAlignment(
        sample_mask=_local(data["sample_mask"]),
        student_chunk_id=_local(data[alignment_prefix + "student_chunk_id"]),
        teacher_chunk_id=teacher[:, start : start + length],
        pair_valid=_local(data[alignment_prefix + "pair_valid"]),
        pair_is_correct=_local(data[alignment_prefix + "pair_is_correct"]),
    )


def _check_cp(student_cp_rank: int, student_cp_size: int, what: str) -> None:
    if int(student_cp_size) < 1 or not 0 <= int(student_cp_rank) < int(student_cp_size):
        raise ValueError(
            f"{what}: need 0 <= student_cp_rank < student_cp_size, got rank {student_cp_rank} "
            f"of {student_cp_size}"
        )


def _window(rank: int, size: int, full_seq_len: int) -> Tuple[int, int]:
    return rank * full_seq_len // size, (rank + 1) * full_seq_len // size


def _shard_geometry(handle: Mapping[str, Any], i: int) -> Tuple[int, int, int, int, int]:
    """``(vocab_start, vocab_end, seq_start, stored_seq, stored_vocab)`` of shard ``i``, checked."""
    if "storage_shape" in handle or "token_offset" in handle:
        raise ValueError(f"teacher shard {i}: compact shard handles are not supported")
    missing = [k for k in _SHARD_KEYS if k not in handle]
    if missing:
        raise ValueError(f"teacher shard {i} lacks {missing}")
    v0, v1, s0 = (int(handle[k]) for k in _SHARD_KEYS[:3])
    shape = handle["actual_shape"]
    if len(shape) != 2:
        raise ValueError(f"teacher shard {i}: actual_shape must be (T_local, V_local), got {shape!r}")
    t_loc, v_loc = int(shape[0]), int(shape[1])
    if v1 - v0 != v_loc or v0 < 0 or s0 < 0 or t_loc < 0:
        raise ValueError(
            f"teacher shard {i}: vocabulary [{v0}, {v1}) does not match actual_shape {tuple(shape)} "
            f"(or a start is negative; global_seq_start {s0})"
        )
    return v0, v1, s0, t_loc, v_loc


def collect_overlapping_teacher_shards(
    teacher_shards: Sequence[Dict[str, Any]],
    student_cp_rank: int,
    student_cp_size: int,
    full_seq_len: int,
) -> List[ShardPlan]:
    """Per shard overlapping this student CP rank's window: ``(shard, src_seq, src_vocab, dest_seq,
    dest_vocab)`` slices, ``dest[dest_seq, dest_vocab] = shard_rows[src_seq, src_vocab]`` with
    ``dest [S / cp, V]``. Shards without overlap are left out; order is the input order."""
    _check_cp(student_cp_rank, student_cp_size, "collect_overlapping_teacher_shards")
    lo, hi = _window(int(student_cp_rank), int(student_cp_size), int(full_seq_len))
    plans: List[ShardPlan] = []
    for i, handle in enumerate(teacher_shards):
        v0, v1, s0, t_loc, _ = _shard_geometry(handle, i)
        a, b = max(lo, s0), min(hi, s0 + t_loc)
        if b <= a:
            continue
        plans.append((handle, slice(a - s0, b - s0), slice(0, v1 - v0), slice(a - lo, b - lo), slice(v0, v1)))
    return plans


def _open_payload(payload: Any, device: Any) -> torch.Tensor:
    """The ``[N, B, T, V]`` storage a shard's ``payload_ipc`` names (see the module doc)."""
    if isinstance(payload, torch.Tensor):
        storage = payload
    elif isinstance(payload, Mapping):
        storage = _open_ipc_handle(payload)
    else:
        raise ValueError(
            "teacher shard payload_ipc must be a tensor or a shardkit IPC handle, got "
            f"{type(payload).__name__}"
        )
    if storage.dim() == 3:
        storage = storage.unsqueeze(0)
    if storage.dim() != 4:
        raise ValueError(f"teacher shard storage must be [N, B, T, V], got shape {tuple(storage.shape)}")
    return storage.detach()


def _shard_rows(handle: Mapping[str, Any], i: int, device: Any) -> torch.Tensor:
    """Shard ``i``'s stored ``[T_local, V_local]`` rows (a view of its storage)."""
    _, _, _, t_loc, v_loc = _shard_geometry(handle, i)
    storage = _open_payload(handle["payload_ipc"], device)
    n, b = int(handle["buf_idx"]), int(handle["sample_index_in_buf"])
    if (
        not (0 <= n < storage.size(0) and 0 <= b < storage.size(1))
        or t_loc > storage.size(2)
        or v_loc > storage.size(3)
    ):
        raise ValueError(
            f"teacher shard {i}: buf_idx {n}, sample_index_in_buf {b}, actual_shape ({t_loc}, {v_loc}) lie "
            f"outside its storage {tuple(storage.shape)}"
        )
    return storage[n, b, :t_loc, :v_loc]


def _full_sizes(shards: Sequence[Mapping[str, Any]], what: str) -> Tuple[int, int]:
    sizes = {(int(h["full_seq_len"]), int(h["full_vocab_size"])) for h in shards}
    if len(sizes) != 1:
        raise ValueError(f"{what}: the shards disagree on (full_seq_len, full_vocab_size): {sorted(sizes)}")
    return sizes.pop()


def assemble_teacher_logits_from_shards(
    teacher_shards: Sequence[Dict[str, Any]],
    student_cp_rank: int,
    student_cp_size: int,
    device: Any,
) -> torch.Tensor:
    """One sample's teacher logits for this student CP rank: fp32 ``[S / cp, V]`` on ``device``.

    Copies every overlapping shard's rows into place (``collect_overlapping_teacher_shards``);
    positions no shard covers are 0. ``ValueError`` for no shards, ``S`` not divisible by ``cp``,
    shards that disagree on ``S`` / ``V`` or reach past them.
    """
    what = "assemble_teacher_logits_from_shards"
    if not teacher_shards:
        raise ValueError(f"{what}: teacher_shards must be non-empty")
    _check_cp(student_cp_rank, student_cp_size, what)
    full_seq_len, full_vocab = _full_sizes(teacher_shards, what)
    if full_seq_len % int(student_cp_size):
        raise ValueError(
            f"{what}: full_seq_len {full_seq_len} is not divisible by student_cp_size {student_cp_size}"
        )
    dest = torch.zeros(full_seq_len // int(student_cp_size), full_vocab, dtype=torch.float32, device=device)
    index = {id(h): i for i, h in enumerate(teacher_shards)}
    for handle, src_seq, src_vocab, dest_seq, dest_vocab in collect_overlapping_teacher_shards(
        teacher_shards, student_cp_rank, student_cp_size, full_seq_len
    ):
        i = index[id(handle)]
        if dest_vocab.stop > full_vocab:
            raise ValueError(
                f"{what}: shard {i}'s vocabulary ends at {dest_vocab.stop} > full_vocab_size {full_vocab}"
            )
        rows = _shard_rows(handle, i, device)
        dest[dest_seq, dest_vocab] = rows[src_seq, src_vocab].to(device=dest.device, dtype=torch.float32)
    return dest


def _try_zero_copy_teacher_logits(
    per_sample_entries: Sequence[Mapping[str, Any]],
    *,
    student_cp_rank: int,
    student_cp_size: int,
    device: Any,
) -> Optional[torch.Tensor]:
    """``[B, S / cp, V]`` view of the storage (no copy, producer's dtype), or None when a copy is needed.

    A view is possible when every sample (``entry["teacher_shards"]``) has exactly one shard that
    holds the whole vocabulary and covers this rank's window, and those shards are rows ``0..B-1``
    of one storage slot (same ``payload_ipc`` and ``buf_idx``, ``sample_index_in_buf == i``) with
    the same ``global_seq_start``. The view lives where the storage does (a CUDA IPC handle opens on
    the producer's device, as PyTorch rebuilds it); ``device`` is accepted for NeMo RL's signature and
    does not move it.
    """
    if not per_sample_entries or not per_sample_entries[0].get("teacher_shards"):
        return None
    _check_cp(student_cp_rank, student_cp_size, "_try_zero_copy_teacher_logits")
    full_seq_len, full_vocab = _full_sizes(
        per_sample_entries[0]["teacher_shards"], "_try_zero_copy_teacher_logits"
    )
    lo, hi = _window(int(student_cp_rank), int(student_cp_size), full_seq_len)
    chosen = []
    for entry in per_sample_entries:
        covering = []
        for i, h in enumerate(entry["teacher_shards"]):
            v0, v1, s0, t_loc, _ = _shard_geometry(h, i)
            if v0 == 0 and v1 == full_vocab and s0 <= lo and s0 + t_loc >= hi:
                covering.append(h)
        if len(covering) != 1:
            return None
        chosen.append(covering[0])
    first = chosen[0]
    for i, h in enumerate(chosen):
        same_payload = h["payload_ipc"] is first["payload_ipc"] or (
            not isinstance(h["payload_ipc"], torch.Tensor) and h["payload_ipc"] == first["payload_ipc"]
        )
        if (
            not same_payload
            or int(h["buf_idx"]) != int(first["buf_idx"])
            or int(h["sample_index_in_buf"]) != i
            or int(h["global_seq_start"]) != int(first["global_seq_start"])
        ):
            return None
    storage = _open_payload(first["payload_ipc"], device)
    n, s0 = int(first["buf_idx"]), int(first["global_seq_start"])
    if (
        n >= storage.size(0)
        or len(chosen) > storage.size(1)
        or hi - s0 > storage.size(2)
        or full_vocab > storage.size(3)
    ):
        raise ValueError(
            f"_try_zero_copy_teacher_logits: the shards' slot {n}, {len(chosen)} samples, rows up to "
            f"{hi - s0} and {full_vocab} columns lie outside the storage {tuple(storage.shape)}"
        )
    return storage[n, : len(chosen), lo - s0 : hi - s0, :full_vocab]


def slice_sparse_projection_cols(sparse_matrix: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """``M[:, col_indices]`` of a sparse COO ``M [V_s, V_t]``: a coalesced sparse ``[V_s, K]``.

    ``col_indices``: 1-D integer ids in ``[0, V_t)``, any order (NeMo RL requires sorted unique
    ids; the result equals the dense ``M[:, col_indices]`` for any order here).
    """
    if not isinstance(sparse_matrix, torch.Tensor) or sparse_matrix.layout != torch.sparse_coo:
        raise TypeError("slice_sparse_projection_cols: sparse_matrix must be a sparse COO tensor")
    if sparse_matrix.dim() != 2:
        raise ValueError(
            f"slice_sparse_projection_cols: expected a 2-D matrix, got {tuple(sparse_matrix.shape)}"
        )
    cols = torch.as_tensor(col_indices, device=sparse_matrix.device)
    if cols.dim() != 1 or cols.is_floating_point() or cols.is_complex():
        raise ValueError(
            "slice_sparse_projection_cols: col_indices must be 1-D integers, got "
            f"{cols.dtype} {tuple(cols.shape)}"
        )
    if cols.numel() and (int(cols.min()) < 0 or int(cols.max()) >= sparse_matrix.size(1)):
        raise ValueError(
            f"slice_sparse_projection_cols: col_indices must lie in [0, {sparse_matrix.size(1)}), "
            f"got [{int(cols.min())}, {int(cols.max())}]"
        )
    return sparse_matrix.index_select(1, cols.long()).coalesce()
