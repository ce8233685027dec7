"""Projection files: parse both on-disk formats, and the per-process caches of what they materialize.

A projection file is a ``torch.save``d dict in one of two formats:

- dense top-k: ``{"indices": LongTensor[V_s, k], "likelihoods": FloatTensor[V_s, k]}``; row ``s``
  lists up to ``k`` teacher ids for student token ``s`` and their weights; ``-1`` marks an unused
  slot (its likelihood is ignored);
- sparse: ``{(student_id, teacher_id): count}`` with non-negative integer ids and real counts.

Files are loaded with ``torch.load(weights_only=True)``: a projection file cannot run code. Counts and
likelihoods must be finite and non-negative, ids below ``MAX_TOKEN_ID``: a file breaking either is a
``ValueError`` naming it (it would otherwise turn the loss into NaN, or fail later without a name).
"""

from __future__ import annotations

import numbers
import os
from typing import Dict, Tuple, Union

import torch

PathLike = Union[str, "os.PathLike[str]"]
# no tokenizer has 2**40 tokens; a larger id is a corrupted file, and would size matrices without bound
MAX_TOKEN_ID = 1 << 40

# Process-local caches (each worker process fills its own on first use). The sparse matrix's shape
# depends on the requested vocabulary sizes, hence the longer key; the top-k arrays do not.
_SPARSE_PROJECTION_CACHE: Dict[Tuple[str, torch.device, int, int], torch.Tensor] = {}
_TOPK_PROJECTION_CACHE: Dict[Tuple[str, torch.device], Tuple[torch.Tensor, torch.Tensor]] = {}
# Filled by ``shardkit.distill.exact_map.build_exact_token_map``; kept here so that one function
# clears every cache derived from a file.
_EXACT_TOKEN_MAP_CACHE: Dict[Tuple[str, torch.device, bool, int], Dict[str, torch.Tensor]] = {}


def _load(path: PathLike) -> object:
    if not os.path.exists(path):
        raise FileNotFoundError(f"projection file not found: {os.fspath(path)}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means "not a projection file"
        raise ValueError(
            f"projection file {os.fspath(path)} cannot be loaded with weights_only=True: {err}"
        ) from err


def _is_dense(data: object) -> bool:
    return isinstance(data, dict) and "indices" in data and "likelihoods" in data


def _dense_arrays(data: dict, path: PathLike) -> Tuple[torch.Tensor, torch.Tensor]:
    indices, likelihoods = data["indices"], data["likelihoods"]
    where = os.fspath(path)
    if not isinstance(indices, torch.Tensor) or not isinstance(likelihoods, torch.Tensor):
        raise ValueError(
            f"projection file {where}: 'indices' and 'likelihoods' must be tensors, got "
            f"{type(indices).__name__} and {type(likelihoods).__name__}"
        )
    if indices.dim() != 2 or indices.shape != likelihoods.shape:
        raise ValueError(
            f"projection file {where}: 'indices' and 'likelihoods' must be 2-D [V_s, k] of the same shape, "
            f"got {tuple(indices.shape)} and {tuple(likelihoods.shape)}"
        )
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise ValueError(f"projection file {where}: 'indices' must be an integer tensor, got {indices.dtype}")
    if not likelihoods.is_floating_point():
        raise ValueError(
            f"projection file {where}: 'likelihoods' must be floating point, got {likelihoods.dtype}"
        )
    indices = indices.long()
    if indices.numel() and int(indices.min()) < -1:
        bad = int(indices.min())
        raise ValueError(f"projection file {where}: teacher id {bad} in 'indices' (only -1 may be negative)")
    if indices.numel() and int(indices.max()) >= MAX_TOKEN_ID:
        raise ValueError(
            f"projection file {where}: teacher id {int(indices.max())} in 'indices' is >= {MAX_TOKEN_ID}"
        )
    used = likelihoods[indices >= 0]
    bad_weights = used[~torch.isfinite(used) | (used < 0)]
    if bad_weights.numel():
        raise ValueError(
            f"projection file {where}: 'likelihoods' must be finite and non-negative, got "
            f"{bad_weights[0].item()} ({bad_weights.numel()} such)"
        )
    return indices, likelihoods.float()


def _sparse_arrays(data: dict, path: PathLike) -> Tuple[torch.Tensor, torch.Tensor]:
    where = os.fspath(path)
    students, teachers, values = [], [], []
    for key, value in data.items():
        ok_key = (
            isinstance(key, tuple)
            and len(key) == 2
            and all(
                isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < MAX_TOKEN_ID
                for i in key
            )
        )
        if not ok_key:
            raise ValueError(
                f"projection file {where}: sparse keys must be (student_id, teacher_id) pairs of "
                f"ints in [0, {MAX_TOKEN_ID}), got {str(key)[:100]}"
            )
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if (
            not isinstance(value, numbers.Real)
            or isinstance(value, bool)
            or not 0 <= float(value) < float("inf")
        ):
            raise ValueError(
                f"projection file {where}: the count of {key!r} must be a finite non-negative number, "
                f"got {str(value)[:100]}"
            )
        students.append(int(key[0]))
        teachers.append(int(key[1]))
        values.append(float(value))
    indices = torch.tensor([students, teachers], dtype=torch.long).reshape(2, -1)
    return indices, torch.tensor(values, dtype=torch.float32)


def parse_projection_file(path: PathLike) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
    """Read a projection file (either format) into COO components, without any sizing policy.

    Returns ``(indices, values, v_student_inferred, v_teacher_inferred)``:

    - ``indices``: ``LongTensor[2, nnz]`` of ``(student_id, teacher_id)``; dense files keep their
      ``-1`` teacher sentinels (one entry per slot, row-major);
    - ``values``: ``FloatTensor[nnz]``;
    - ``v_student_inferred``: dense: the number of rows; sparse: ``max(student_id) + 1`` (0 if empty);
    - ``v_teacher_inferred``: ``max(non-negative teacher_id) + 1`` (0 if there is none).

    Raises ``FileNotFoundError`` when ``path`` does not exist and ``ValueError`` when the file is
    not in a recognized format (or cannot be loaded with ``weights_only=True``).
    """
    data = _load(path)
    if _is_dense(data):
        top_indices, top_likelihoods = _dense_arrays(data, path)
        v_student, k = top_indices.shape
        student = torch.arange(v_student).unsqueeze(1).expand(v_student, k).reshape(-1)
        teacher = top_indices.reshape(-1)
        real = teacher[teacher >= 0]
        v_teacher = int(real.max()) + 1 if real.numel() else 0
        return torch.stack([student, teacher]), top_likelihoods.reshape(-1), int(v_student), v_teacher
    if isinstance(data, dict):
        indices, values = _sparse_arrays(data, path)
        v_student = int(indices[0].max()) + 1 if indices.size(1) else 0
        v_teacher = int(indices[1].max()) + 1 if indices.size(1) else 0
        return indices, values, v_student, v_teacher
    raise ValueError(
        f"projection file {os.fspath(path)} holds a {type(data).__name__}; expected a dict with "
        f"'indices' and 'likelihoods' tensors (dense top-k) or a dict "
        f"{{(student_id, teacher_id): count}} (sparse)"
    )


def _check_size(name: str, value: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def get_sparse_projection_matrix(
    path: PathLike, device: torch.device, *, student_vocab_size: int, teacher_vocab_size: int
) -> torch.Tensor:
    """The projection as a coalesced fp32 sparse COO ``[V_s, V_t]`` on ``device`` (cached per process).

    ``V_s = max(student_vocab_size, max student id + 1)`` and likewise ``V_t``: the vocabulary sizes
    are minimum widths (a file need not mention the highest ids). Entries with the ``-1`` teacher
    sentinel are dropped. Duplicate ``(s, t)`` entries are summed by coalescing. Cached under
    ``(str(path), device, student_vocab_size, teacher_vocab_size)``: later calls do no I/O and
    return the same tensor (do not modify it). ``clear_projection_caches()`` empties the caches.
    """
    s_size = _check_size("student_vocab_size", student_vocab_size)
    t_size = _check_size("teacher_vocab_size", teacher_vocab_size)
    key = (os.fspath(path), torch.device(device), s_size, t_size)
    cached = _SPARSE_PROJECTION_CACHE.get(key)
    if cached is not None:
        return cached
    indices, values, _, _ = parse_projection_file(path)
    keep = indices[1] >= 0  # the -1 "no teacher token" slots are not matrix entries
    indices, values = indices[:, keep], values[keep]
    v_s = max(s_size, int(indices[0].max()) + 1 if indices.size(1) else 0)
    v_t = max(t_size, int(indices[1].max()) + 1 if indices.size(1) else 0)
    matrix = torch.sparse_coo_tensor(indices, values, (v_s, v_t), dtype=torch.float32, check_invariants=True)
    matrix = matrix.coalesce().to(torch.device(device))
    _SPARSE_PROJECTION_CACHE[key] = matrix
    return matrix


def get_topk_projection(path: PathLike, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The dense top-k arrays ``(indices LongTensor[V_s, k], likelihoods FloatTensor[V_s, k])`` on ``device``.

    Cached per process under ``(str(path), device)``. Raises ``FileNotFoundError`` for a missing file
    and ``ValueError`` for a file that is not in the dense top-k format (the sparse format carries
    no per-row weights, which the exact-token map needs).
    """
    key = (os.fspath(path), torch.device(device))
    cached = _TOPK_PROJECTION_CACHE.get(key)
    if cached is not None:
        return cached
    data = _load(path)
    if not _is_dense(data):
        raise ValueError(
            f"projection file {os.fspath(path)} is not in the dense top-k format (a dict with 'indices' and "
            f"'likelihoods' tensors), which the exact-token map needs"
        )
    indices, likelihoods = _dense_arrays(data, path)
    result = (indices.to(torch.device(device)), likelihoods.to(torch.device(device)))
    _TOPK_PROJECTION_CACHE[key] = result
    return result


def clear_projection_caches() -> None:
    """Empty every per-process projection cache (also the exact-token maps), e.g. after rewriting a file."""
    _SPARSE_PROJECTION_CACHE.clear()
    _TOPK_PROJECTION_CACHE.clear()
    _EXACT_TOKEN_MAP_CACHE.clear()
