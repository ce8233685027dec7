"""Random KeyedJaggedTensor batches for the module tests (ids in range, some empty bags, repeats)."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from shardkit.sparse import KeyedJaggedTensor


def random_kjt(
    rows_per_key: Dict[str, int],
    batch: int,
    max_length: int = 4,
    weighted: bool = False,
    seed: int = 0,
    keys: Optional[List[str]] = None,
) -> KeyedJaggedTensor:
    """Keys in ``keys`` order (default: the dict's); ids of key k drawn from ``[0, rows_per_key[k])``.

    Lengths include 0 (empty bags).
    """
    gen = torch.Generator().manual_seed(seed)
    keys = list(rows_per_key) if keys is None else keys
    lengths = torch.randint(0, max_length + 1, (len(keys) * batch,), generator=gen)
    counts = lengths.view(len(keys), batch).sum(dim=1).tolist()
    # ids of each key come from a pool of 5 rows that always holds the last row: repeats and the
    # upper edge of the range are both exercised
    pools = {
        k: torch.cat(
            [torch.randint(0, rows_per_key[k], (4,), generator=gen), torch.tensor([rows_per_key[k] - 1])]
        )
        for k in keys
    }
    values = torch.cat([pools[k][torch.randint(0, 5, (n,), generator=gen)] for k, n in zip(keys, counts)])
    weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights=weights)
