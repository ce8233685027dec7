"""EmbeddingCollection index deduplication (torchrec's ``set_ec_index_dedup`` / ``get_ec_index_dedup``).

With the switch on when a ``ShardedEmbeddingCollection`` is built, every forward sends each distinct
id of a feature once (to the rank or ranks holding its rows) instead of once per occurrence, and copies
the looked-up row back to every occurrence after the output dist. Forward rows are bitwise those of the
path without deduplication (the same rows are read). In backward the gradients of an id's occurrences
are summed on the sending rank before they travel, so the table's gradient is the same sum in another
association order: bitwise equal where those float sums are exact, otherwise equal to rounding
(as in torchrec, whose deduplication also pre-sums).

The switch is process-wide and registered in ``shardkit.distributed.switches``: ranks that disagree
get a ``ValueError`` on every rank when the module is built and in every forward's input check.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from shardkit.distributed.switches import register_switch
from shardkit.sparse import KeyedJaggedTensor

_EC_INDEX_DEDUP = False


def set_ec_index_dedup(val: bool) -> None:
    """Turn EmbeddingCollection index deduplication on or off for this process (torchrec's name).

    Read when a ``ShardedEmbeddingCollection`` is built (as torchrec does): modules built earlier keep
    their setting. Every rank must set the same value (checked; ``ValueError`` on every rank)."""
    global _EC_INDEX_DEDUP
    if not isinstance(val, bool):
        raise TypeError(f"set_ec_index_dedup takes a bool, got {type(val).__name__} {val!r}")
    _EC_INDEX_DEDUP = val


def get_ec_index_dedup() -> bool:
    """Whether sharded EmbeddingCollections built from now on deduplicate their input ids."""
    return _EC_INDEX_DEDUP


register_switch("EC index dedup (set_ec_index_dedup)", get_ec_index_dedup)


def dedup_features(features: KeyedJaggedTensor) -> Tuple[KeyedJaggedTensor, Dict[str, torch.Tensor]]:
    """``(deduplicated, {key: inverse})``: per key the distinct ids (ascending) of ``features``.

    ``deduplicated`` has ``features``' keys and batch layout (stride, or stride per key per rank and
    inverse indices); each key's distinct ids are the first sample's, its other samples are empty (a
    key with no samples has no ids). ``inverse[key]``: int64 ``[ids of key]``, the position of each
    original id among the key's distinct ids, so ``rows[inverse]`` gives every occurrence its row.
    Weights are dropped (an EmbeddingCollection does not read them).
    """
    keys = features.keys()
    ids_per_key = features.values().split(features.length_per_key())
    uniques: List[torch.Tensor] = []
    inverse: Dict[str, torch.Tensor] = {}
    for key, ids in zip(keys, ids_per_key):
        distinct, where = torch.unique(ids, sorted=True, return_inverse=True)
        uniques.append(distinct)
        inverse[key] = where
    lengths = features.lengths()
    new_lengths = torch.zeros_like(lengths)
    start = 0
    for distinct, samples in zip(uniques, features.stride_per_key()):
        if samples:  # a key without samples has no ids, so nothing to place
            new_lengths[start] = distinct.numel()
        start += samples
    variable = features.variable_stride_per_key()
    inv = features.inverse_indices_or_none()
    values = torch.cat(uniques) if uniques else features.values()[:0]
    deduplicated = KeyedJaggedTensor(
        keys,
        values,
        None,
        lengths=new_lengths,
        stride=None if variable else features.stride(),
        stride_per_key_per_rank=features.stride_per_key_per_rank() if variable else None,
        inverse_indices=None if inv is None else (keys, inv[1]),
        validate=False,
    )
    return deduplicated, inverse


def expand_rows(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``[distinct ids, D]`` rows -> ``[ids, D]``: occurrence ``i`` gets ``rows[inverse[i]]`` (a copy;
    the backward sums each occurrence's gradient into its distinct row)."""
    return rows.index_select(0, inverse)


__all__ = ["dedup_features", "expand_rows", "get_ec_index_dedup", "set_ec_index_dedup"]
