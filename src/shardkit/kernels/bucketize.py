"""Row-wise input distribution's bucketize: each id to the row block holding it, grouped by destination.

Ids of F features arrive feature-major in bags (a KeyedJaggedTensor's values / offsets). Feature f's
rows are split into blocks (ascending first rows ``block_starts[f]``), and block j of feature f goes
out under the sent key ``block_keys[f][j]``. Each sent key k carries the bags of its feature, so the
sent KJT has one segment (bag) per (key, sample): segment = (first segment of k) + sample. The result
is the stable order that sorts the ids by segment (a bag's ids keep their order), the length of every
segment, and the ids in that order. Native C++ on CPU (a counting sort, one pass to place the ids)
with this pure-torch path as reference and fallback.
"""

from __future__ import annotations

from itertools import accumulate
from typing import List, Optional, Sequence, Tuple

import torch

from shardkit.kernels.embedding import native_for
from shardkit.kernels.embedding_torch import bag_of_each_id

__all__ = ["BlockTensors", "bucketize_blocks"]


def bucketize_blocks(
    values: torch.Tensor,
    offsets: torch.Tensor,
    bags_per_feature: Sequence[int],
    block_starts: Sequence[Sequence[int]],
    block_keys: Sequence[Sequence[int]],
    key_feature: Sequence[int],
    ids_per_feature: Optional[Sequence[int]] = None,
    backend: str = "auto",
    need_order: bool = True,
    fixed: Optional[BlockTensors] = None,
) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Returns (order int64 ``[N]``, lengths int64 ``[S]``, ``values[order]``).

    values: int32 / int64 ``[N]``; offsets: ``[sum(bags_per_feature) + 1]``; block_starts / block_keys:
    per feature, its blocks' first rows (ascending) and sent keys; key_feature: the feature of each sent
    key (keys numbered 0..K-1). ``S = sum(bags_per_feature[key_feature[k]] for k)``. ids_per_feature:
    the number of ids of each feature if known (the torch path reads it from offsets otherwise).
    backend: "auto" (native when it can run and :func:`~shardkit.kernels.kernel_backend` does not force
    another), "native" or "torch". need_order: False returns None for ``order`` (the native kernel
    then does not write it: a pooled unweighted row-wise lookup only sends the sorted ids).
    fixed: the native kernel's index tensors of these ``block_starts`` / ``block_keys`` /
    ``key_feature`` and of the last ``bags_per_feature`` seen, made once (:class:`BlockTensors`, built
    from the same lists) instead of from the lists at every call.
    """
    offsets = offsets.to(torch.int64)
    key_bags = [bags_per_feature[f] for f in key_feature]
    num_segments = sum(key_bags)
    native = None if backend == "torch" else native_for(values.device)
    if backend == "native" and native is None:
        raise RuntimeError("the native bucketize kernel is not available")
    if native is not None and values.dtype in (torch.int32, torch.int64):
        device = values.device

        if fixed is None:
            fixed = BlockTensors(block_starts, block_keys, key_feature)
        bags, starts, bounds, keys, first_bags = fixed.on(device, bags_per_feature)
        order, lengths, sent = native.bucketize_blocks(
            values.contiguous(),
            offsets.contiguous(),
            bags,
            starts,
            bounds,
            keys,
            first_bags,
            num_segments,
            need_order,
        )
        return (order if need_order else None), lengths, sent
    order, lengths, sent = _bucketize_torch(
        values, offsets, bags_per_feature, block_starts, block_keys, key_feature, ids_per_feature
    )
    return (order if need_order else None), lengths, sent


class BlockTensors:
    """The native bucketize kernel's index tensors for one row-block plan, made once per device: the
    blocks' first rows (flat), each feature's range of blocks, the blocks' sent keys (flat); and,
    for the last ``bags_per_feature`` seen (the batch size, which rarely changes), each feature's
    first bag and each sent key's first segment. A row-wise step at small batches built these
    five int64 tensors from Python lists at every call (``torch.tensor`` of lists of up to a few
    hundred entries): fixed per plan, they need not be. Built from the same lists as the call's.
    """

    def __init__(
        self,
        block_starts: Sequence[Sequence[int]],
        block_keys: Sequence[Sequence[int]],
        key_feature: Sequence[int],
    ) -> None:
        self._lists = (
            [row for starts in block_starts for row in starts],
            [0, *accumulate(len(starts) for starts in block_starts)],
            [k for keys in block_keys for k in keys],
        )
        self._key_feature = list(key_feature)
        self._plan: dict = {}  # device -> (starts, bounds, keys)
        self._batch: Optional[tuple] = None  # (device, bags_per_feature, bags tensor, first bags tensor)

    def on(self, device: torch.device, bags_per_feature: Sequence[int]) -> Tuple[torch.Tensor, ...]:
        """``(bag bounds [F + 1], block first rows, block bounds [F + 1], block keys, first segment
        of each key [K])``, int64 on ``device``."""
        plan = self._plan.get(device)
        if plan is None:
            plan = self._plan[device] = tuple(_int64(data, device) for data in self._lists)
        bags_key = tuple(bags_per_feature)
        if self._batch is None or self._batch[0] != device or self._batch[1] != bags_key:
            key_bags = [bags_key[f] for f in self._key_feature]
            self._batch = (
                device,
                bags_key,
                _int64([0, *accumulate(bags_key)], device),
                _int64([0, *accumulate(key_bags)][:-1], device),
            )
        return self._batch[2], plan[0], plan[1], plan[2], self._batch[3]


def _int64(data: List[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(data, dtype=torch.int64, device=device)


def _bucketize_torch(values, offsets, bags_per_feature, block_starts, block_keys, key_feature, counts):
    device = values.device
    if counts is None:
        bounds = torch.tensor([0, *accumulate(bags_per_feature)], device=device)
        counts = offsets.index_select(0, bounds).diff().tolist()
    key_of_id = []
    for i, ids in enumerate(values.split(counts)):
        starts = torch.tensor(block_starts[i], dtype=ids.dtype, device=device)
        keys = torch.tensor(block_keys[i], dtype=torch.int64, device=device)
        block = (torch.searchsorted(starts, ids, right=True) - 1).clamp_(min=0)
        key_of_id.append(keys.index_select(0, block))
    key = torch.cat(key_of_id) if key_of_id else values.new_zeros(0, dtype=torch.int64)
    bag_start = [0, *accumulate(bags_per_feature)]
    key_bags = [bags_per_feature[f] for f in key_feature]
    row_start = torch.tensor(list(accumulate([0, *key_bags[:-1]])), dtype=torch.int64, device=device)
    feature_start = torch.tensor([bag_start[f] for f in key_feature], dtype=torch.int64, device=device)
    bag = bag_of_each_id(offsets, values.numel())
    segment = row_start.index_select(0, key) + bag - feature_start.index_select(0, key)
    # stable: the ids of one bag keep their order, so a block's bag is the original bag filtered
    order = torch.argsort(segment, stable=True)
    lengths = torch.bincount(segment, minlength=sum(key_bags))
    return order, lengths, values.index_select(0, order)
