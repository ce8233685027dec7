"""Where a rank's vocabulary slice comes from: explicit offsets, even shards, or a DTensor's mesh.

Every loss accepts its logits (or, for the fused linear loss, its weight) in one of three forms:

- a plain tensor with explicit ``vocab_start_index`` / ``vocab_end_index`` (uneven shards allowed);
- a plain tensor without them: even shards, rank ``r`` of ``group`` holds ``[r * w, (r + 1) * w)``;
- a ``DTensor`` sharded on its last dimension (``Shard(-1)``) along one mesh dimension and replicated
  along any others: the group is that mesh dimension's process group and the offsets follow
  DTensor's own split rule (``torch.chunk``: ``ceil(V / n)`` columns per rank, the last ones shorter
  or empty). Passing a group or offsets as well is an error, since the mesh already says them.

The result of a loss is a plain tensor, the same on every rank of the group; gradients flow back to
the DTensor through ``to_local``, so the DTensor receives a gradient with its own placements.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import group_rank

try:  # public since torch 2.4; older releases kept it under torch.distributed._tensor
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - depends on the torch release
    try:
        from torch.distributed._tensor import DTensor
    except ImportError:
        DTensor = None


def is_dtensor(value: Any) -> bool:
    return DTensor is not None and isinstance(value, DTensor)


def plain_tensor(value: Any) -> Any:
    """A DTensor's full value as a plain tensor (targets, labels); anything else unchanged."""
    return value.full_tensor() if is_dtensor(value) else value


def resolve_vocab_shard(
    logits: Any,
    group: Optional[dist.ProcessGroup],
    vocab_start_index: Optional[int],
    vocab_end_index: Optional[int],
    op: str,
) -> tuple[torch.Tensor, Optional[dist.ProcessGroup], int, int]:
    """``(local shard [..., w], group, start, end)`` for the three forms above.

    Raises ``ValueError`` (locally, before any collective: these are facts of the call on this rank)
    for a DTensor that is not sharded on its last dim, or for a half-given slice.
    """
    if is_dtensor(logits):
        return _from_dtensor(logits, group, vocab_start_index, vocab_end_index, op)
    if (vocab_start_index is None) != (vocab_end_index is None):
        raise ValueError(
            f"{op}: give both vocab_start_index and vocab_end_index or neither, got "
            f"{vocab_start_index} and {vocab_end_index}"
        )
    if vocab_start_index is not None:
        return logits, group, int(vocab_start_index), int(vocab_end_index)
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        return logits, group, 0, 0  # reported by the checks, which know the whole call
    width = logits.size(-1)
    rank = group_rank(group)  # -1 for a non-member: the checks then report that, before any collective
    return logits, group, rank * width, (rank + 1) * width


def _from_dtensor(
    logits: Any, group: Any, start: Optional[int], end: Optional[int], op: str
) -> tuple[torch.Tensor, dist.ProcessGroup, int, int]:
    if group is not None or start is not None or end is not None:
        raise ValueError(
            f"{op}: a DTensor carries its own process group and vocabulary offsets; do not pass "
            "group, vocab_start_index or vocab_end_index with it"
        )
    last = logits.dim() - 1
    placements = tuple(logits.placements)
    vocab_dims = [i for i, p in enumerate(placements) if p.is_shard() and p.dim in (last, -1)]
    others = [p for i, p in enumerate(placements) if i not in vocab_dims and not p.is_replicate()]
    if len(vocab_dims) != 1 or others:
        raise ValueError(
            f"{op}: a DTensor input must be sharded on its last (vocabulary) dimension along exactly one "
            f"mesh dimension and replicated along the others, got placements {placements}"
        )
    mesh_dim = vocab_dims[0]
    mesh = logits.device_mesh
    parts, rank = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    vocab = logits.size(-1)
    chunk = -(-vocab // parts)  # torch.chunk's rule, which DTensor's Shard placement follows
    start = min(rank * chunk, vocab)
    end = min(start + chunk, vocab)
    return logits.to_local(), mesh.get_group(mesh_dim), start, end
