"""Per-rank sparse inputs for the sharding tests, as rows (lists of ids) and as KeyedJaggedTensors.

Every rank builds every rank's rows from fixed seeds, so a plain-Python reference can be computed
anywhere.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from shardkit.sparse import KeyedJaggedTensor

KEYS = ["f0", "f1", "f2", "f3", "f4"]
BATCH = [2, 3, 1, 4]  # batch size of each rank when batches differ
NUM_IDS = 20  # ids are drawn from [0, NUM_IDS)

Rows = Dict[str, List[List[int]]]


def random_rows(seed: int, num_rows: int, max_len: int = 3) -> List[List[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (num_rows,), generator=gen).tolist()
    return [torch.randint(0, NUM_IDS, (n,), generator=gen).tolist() for n in lengths]


def input_rows(rank: int, batch_per_key: List[int]) -> Rows:
    """Rank ``rank``'s rows per key; ``batch_per_key[k]`` rows for key k."""
    return {k: random_rows(1000 * rank + 10 * i, batch_per_key[i]) for i, k in enumerate(KEYS)}


def batches(rank: int, mode: str) -> List[int]:
    """Rows per key on ``rank``: equal, per-rank ("uneven"), or per-key per-rank ("variable")."""
    if mode == "equal":
        return [3] * len(KEYS)
    if mode == "uneven":
        return [BATCH[rank]] * len(KEYS)
    return [(rank + 2 * i) % 4 for i in range(len(KEYS))]


def build_kjt(rows: Rows, mode: str = "equal", weighted: bool = False) -> KeyedJaggedTensor:
    """A KJT of ``rows`` (int32 lengths, int64 ids; weights = id / 7 in float64 when weighted)."""
    keys = list(rows)
    lengths = torch.tensor([len(r) for k in keys for r in rows[k]], dtype=torch.int32)
    values = torch.tensor([v for k in keys for r in rows[k] for v in r], dtype=torch.int64)
    weights = values.to(torch.float64) / 7 if weighted else None
    spkpr = [[len(rows[k])] for k in keys] if mode == "variable" else None
    stride = None if mode == "variable" else len(rows[keys[0]])
    return KeyedJaggedTensor(
        keys, values, weights, lengths=lengths, stride=stride, stride_per_key_per_rank=spkpr
    )


def splits_for(world: int) -> List[List[int]]:
    """A few splits of the 5 keys over ``world`` ranks, including one that gives a rank no keys."""
    return {1: [[5]], 2: [[2, 3], [5, 0]], 3: [[2, 1, 2], [0, 4, 1]], 4: [[1, 2, 0, 2], [2, 1, 1, 1]]}[world]
