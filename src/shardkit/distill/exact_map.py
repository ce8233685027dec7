"""The exact-token map: student tokens with one teacher counterpart (the gold loss's common vocabulary)."""

from __future__ import annotations

import os
from typing import Dict

import torch

from shardkit.distill.projection_files import (
    _EXACT_TOKEN_MAP_CACHE,
    PathLike,
    _check_size,
    get_topk_projection,
)

# The relaxed rule's threshold on a row's top likelihood.
RELAXED_THRESHOLD = 0.6


def build_exact_token_map(
    path: PathLike, device: torch.device, *, xtoken_loss: bool, teacher_vocab_size: int
) -> Dict[str, torch.Tensor]:
    """Partition both vocabularies into a paired common part and the uncommon rest (cached per process).

    Reads the dense top-k file (``get_topk_projection``), sorts each student row's likelihoods in
    descending order (stable: equal weights keep file order), and takes the row's top teacher id as
    its candidate when

    - strict (``xtoken_loss=False``): the top sorted likelihood ``== 1.0`` and file column 1 of
      ``indices`` is ``-1`` (no second mapping; a file with ``k == 1`` has no column 1 and counts as
      ``-1``). Several students on one teacher id: the lowest student id wins.
    - relaxed (``xtoken_loss=True``): the top sorted likelihood ``>= 0.6``. Several students on one
      teacher id: the highest top likelihood wins, ties go to the lowest student id.

    Candidates whose teacher id is outside ``[0, teacher_vocab_size)`` are dropped (so is a row whose
    top likelihood sits in a ``-1`` slot: the sentinel is outside the vocabulary too).

    Returns a dict of int64 tensors on ``device``: ``common_student`` (ascending) with the paired
    ``common_teacher``; ``uncommon_student`` (ascending ids in ``[0, V_s)`` not in the common part) and
    ``uncommon_teacher`` (ascending ids in ``[0, teacher_vocab_size)`` not in the common part).
    Vectorized (sort + ``scatter_reduce``); cached under
    ``(str(path), device, xtoken_loss, teacher_vocab_size)``; the tensors are shared, do not modify them.
    """
    v_t = _check_size("teacher_vocab_size", teacher_vocab_size)
    device = torch.device(device)
    key = (os.fspath(path), device, bool(xtoken_loss), v_t)
    cached = _EXACT_TOKEN_MAP_CACHE.get(key)
    if cached is not None:
        return cached
    indices, likelihoods = get_topk_projection(path, device)
    v_s, k = indices.shape
    if k == 0:
        candidate = torch.zeros(v_s, dtype=torch.bool, device=device)
        top_value = torch.zeros(v_s, dtype=torch.float32, device=device)
        top_teacher = torch.full((v_s,), -1, dtype=torch.long, device=device)
    else:
        sorted_values, order = torch.sort(likelihoods, dim=1, descending=True, stable=True)
        top_value = sorted_values[:, 0]
        top_teacher = indices.gather(1, order[:, :1]).squeeze(1)
        if xtoken_loss:
            candidate = top_value >= RELAXED_THRESHOLD
        else:
            no_second = indices[:, 1] == -1 if k > 1 else torch.ones(v_s, dtype=torch.bool, device=device)
            candidate = (top_value == 1.0) & no_second
    candidate &= (top_teacher >= 0) & (top_teacher < v_t)
    s_vec = torch.nonzero(candidate).squeeze(1)
    t_vec = top_teacher[s_vec]
    if xtoken_loss:
        best = torch.full((v_t,), float("-inf"), dtype=top_value.dtype, device=device)
        best = best.scatter_reduce(0, t_vec, top_value[s_vec], reduce="amax")
        eligible = top_value[s_vec] >= best[t_vec]
    else:
        eligible = torch.ones_like(s_vec, dtype=torch.bool)
    sentinel = torch.full_like(s_vec, v_s)
    lowest = torch.full((v_t,), v_s, dtype=torch.long, device=device)
    lowest = lowest.scatter_reduce(0, t_vec, torch.where(eligible, s_vec, sentinel), reduce="amin")
    wins = eligible & (s_vec == lowest[t_vec])
    common_student, common_teacher = s_vec[wins], t_vec[wins]  # nonzero() keeps students ascending
    is_common_s = torch.zeros(v_s, dtype=torch.bool, device=device)
    is_common_s[common_student] = True
    is_common_t = torch.zeros(v_t, dtype=torch.bool, device=device)
    is_common_t[common_teacher] = True
    result = {
        "common_student": common_student,
        "common_teacher": common_teacher,
        "uncommon_student": torch.nonzero(~is_common_s).squeeze(1),
        "uncommon_teacher": torch.nonzero(~is_common_t).squeeze(1),
    }
    _EXACT_TOKEN_MAP_CACHE[key] = result
    return result
