"""The two vocabulary ends of a tensor-parallel language model: input embedding and output head.

Rank ``r`` of the tensor-parallel group holds rows ``[vocab_start_index, vocab_end_index)`` of the
``[V, H]`` table: ``split_sizes(V, tp)`` by default (the first ``V % tp`` ranks one row more), or any
explicit ``sizes`` (a rank may hold none).

- ``VocabParallelEmbedding``: token ids ``[*]`` (the same on every rank) -> hidden ``[*, H]``. Each rank
  looks up the ids in its range (other ids give zero rows) and the partial results are summed over the
  group (``reduce_from_region``: all-reduce forward, identity backward), so every rank gets the full
  embedding and each shard's gradient holds only its own rows.
- ``ParallelLMHead``: replicated hidden ``[*, H]`` -> this rank's logits shard ``[*, V_r]``
  (``copy_to_region``: identity forward, all-reduce of the hidden gradient backward, so a replicated
  trunk gets the gradient of the whole vocabulary). ``cross_entropy`` feeds the shard to
  ``vocab_parallel_cross_entropy`` with the right vocabulary range, without gathering the logits.
- Tied input / output weights: ``ParallelLMHead(..., tie_to=embedding)`` uses the embedding's weight
  ``Parameter`` itself, so both gradients accumulate into one shard, as in an unsharded model whose
  head is ``F.linear(h, embedding.weight)``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.distributed.agreement import group_rank, group_size
from shardkit.distributed.regions import copy_to_region, reduce_from_region
from shardkit.distributed.tensor_split import split_sizes
from shardkit.distributed.validation import validation_enabled
from shardkit.losses.cross_entropy import vocab_parallel_cross_entropy


def _vocab_range(
    vocab_size: int, group: Optional[dist.ProcessGroup], sizes: Optional[Sequence[int]]
) -> tuple[int, int, list[int]]:
    """``(start, end, sizes)`` of this rank's rows; ``ValueError`` naming the sizes when they cannot work."""
    world, rank = group_size(group), group_rank(group)
    if vocab_size < 1:
        raise ValueError(f"vocabulary size must be >= 1, got {vocab_size}")
    sizes = split_sizes(vocab_size, world) if sizes is None else [int(s) for s in sizes]
    if len(sizes) != world or sum(sizes) != vocab_size or min(sizes) < 0:
        raise ValueError(
            f"rank {rank}: sizes {sizes} must be {world} non-negative row counts summing to the "
            f"vocabulary size {vocab_size}"
        )
    start = sum(sizes[:rank])
    return start, start + sizes[rank], sizes


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(V, H)`` with its rows split over ``group``: ids ``[*]`` -> ``[*, H]`` on every rank.

    ``weight``: this rank's rows ``[V_r, H]``, initialized like ``nn.Embedding`` (standard normal);
    ``copy_full_weight_(full)`` loads the rank's rows of a full ``[V, H]`` table. The ids must be the
    same on every rank (tensor parallelism splits the model, not the data); an id outside ``[0, V)``
    is an ``IndexError`` naming it (one host sync per call, off with
    ``shardkit.distributed.validation.set_validation(False)``). Saved for backward: the ids and the mask
    of ids outside this rank's range.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: Optional[dist.ProcessGroup] = None,
        sizes: Optional[Sequence[int]] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.vocab_start_index, self.vocab_end_index, self.sizes = _vocab_range(num_embeddings, group, sizes)
        rows = self.vocab_end_index - self.vocab_start_index
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)

    @torch.no_grad()
    def copy_full_weight_(self, full: torch.Tensor) -> None:
        """Copy this rank's rows of the full table ``[V, H]`` into ``weight``."""
        if tuple(full.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"full weight has shape {tuple(full.shape)}, expected "
                f"{(self.num_embeddings, self.embedding_dim)}"
            )
        self.weight.copy_(full[self.vocab_start_index : self.vocab_end_index])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"ids must be int32 or int64, got {ids.dtype}")
        if validation_enabled() and ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.num_embeddings:
                bad = low if low < 0 else high
                raise IndexError(
                    f"rank {group_rank(self.group)}: id {bad} is outside the vocabulary "
                    f"[0, {self.num_embeddings})"
                )
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        if self.weight.shape[0] == 0:
            # no rows here: zeros that still belong to the graph, so backward reaches the empty weight
            partial = ids.new_zeros((), dtype=self.weight.dtype).expand(*ids.shape, self.embedding_dim)
            partial = partial + self.weight.sum()
        else:
            local = (ids - self.vocab_start_index).masked_fill(outside, 0)
            partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_region(partial, self.group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start_index}, "
            f"{self.vocab_end_index}) of sizes {self.sizes}"
        )


class ParallelLMHead(nn.Module):
    """``nn.Linear(H, V, bias=False)`` with its output rows split over ``group``: ``[*, H]`` -> ``[*, V_r]``.

    The hidden states must be the same on every rank; the result is this rank's logits shard, columns
    ``[vocab_start_index, vocab_end_index)`` of the full logits. ``tie_to``: a ``VocabParallelEmbedding``
    of the same vocabulary, group and sizes whose ``weight`` Parameter this head uses (tied input and
    output embeddings); otherwise the head owns ``weight [V_r, H]``, initialized like ``nn.Linear``.
    Saved for backward: the hidden states and the weight (``F.linear``'s).
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        group: Optional[dist.ProcessGroup] = None,
        sizes: Optional[Sequence[int]] = None,
        tie_to: Optional[VocabParallelEmbedding] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.hidden_size, self.vocab_size, self.group = hidden_size, vocab_size, group
        self.vocab_start_index, self.vocab_end_index, self.sizes = _vocab_range(vocab_size, group, sizes)
        if tie_to is not None:
            mismatch = [
                f"{name} {mine} != the embedding's {theirs}"
                for name, mine, theirs in (
                    ("vocab_size", vocab_size, tie_to.num_embeddings),
                    ("hidden_size", hidden_size, tie_to.embedding_dim),
                    ("sizes", self.sizes, tie_to.sizes),
                )
                if mine != theirs
            ]
            if tie_to.group is not group:
                mismatch.append("the process group is not the embedding's")
            if mismatch:
                raise ValueError(f"ParallelLMHead(tie_to=...): {'; '.join(mismatch)}")
            self.weight = tie_to.weight  # the same Parameter: one shard, both gradients
        else:
            rows = self.vocab_end_index - self.vocab_start_index
            self.weight = nn.Parameter(torch.empty(rows, hidden_size, device=device, dtype=dtype))
            bound = 1.0 / math.sqrt(hidden_size)  # nn.Linear's default, fan_in = hidden_size
            nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits shard ``[*, V_r]``, in the dtype of ``hidden`` and ``weight``."""
        return F.linear(copy_to_region(hidden, self.group), self.weight)

    def cross_entropy(self, hidden: torch.Tensor, target: torch.Tensor, **kwargs) -> torch.Tensor:
        """``vocab_parallel_cross_entropy`` of this head's logits shard against global ``target`` ids.

        ``kwargs`` go to ``vocab_parallel_cross_entropy`` (``reduction``, ``ignore_index``,
        ``label_smoothing``, ``z_loss``, ...); the group and the vocabulary range are this head's.
        """
        return vocab_parallel_cross_entropy(
            self(hidden),
            target,
            group=self.group,
            vocab_start_index=self.vocab_start_index,
            vocab_end_index=self.vocab_end_index,
            vocab_size=self.vocab_size,
            **kwargs,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size} -> {self.vocab_size}, rows [{self.vocab_start_index}, "
            f"{self.vocab_end_index}) of sizes {self.sizes}"
        )


__all__ = ["ParallelLMHead", "VocabParallelEmbedding"]
