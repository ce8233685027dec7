"""``RandomRecDataset``: random click batches, torchrec's ``torchrec.datasets.random.RandomRecDataset``."""

from __future__ import annotations

from typing import Iterator, List, Optional

import torch
from torch.utils.data import IterableDataset

from shardkit.datasets.utils import Batch
from shardkit.sparse import KeyedJaggedTensor


def _per_key(
    name: str, one: Optional[int], per_key: Optional[List[int]], default: int, keys: List[str]
) -> List[int]:
    if per_key is None:
        return [default if one is None else one] * len(keys)
    if len(per_key) != len(keys):
        raise ValueError(f"RandomRecDataset: {len(per_key)} {name} for {len(keys)} keys {keys}")
    return list(per_key)


class RandomRecDataset(IterableDataset):
    """Batches of ``batch_size`` samples: ``num_dense`` standard-normal dense features, one bag per key
    of ``min_ids..ids_per_feature`` (inclusive) uniform ids in ``[0, hash_size)``, 0/1 int64 labels.

    Args (torchrec's): ``keys``, ``batch_size``, ``hash_size`` (default 100) or ``hash_sizes`` per key,
    ``ids_per_feature`` (default 2) or ``ids_per_features``, ``num_dense`` (50), ``manual_seed``
    (None: torch's global generator), ``num_batches`` (None: endless), ``num_generated_batches`` (10
    batches generated up front and cycled; negative: a new batch every time), ``min_ids_per_feature``
    / ``min_ids_per_features`` (default: ``ids_per_feature`` when given, else 0).
    """

    def __init__(
        self,
        keys: List[str],
        batch_size: int,
        hash_size: Optional[int] = None,
        hash_sizes: Optional[List[int]] = None,
        ids_per_feature: Optional[int] = None,
        ids_per_features: Optional[List[int]] = None,
        num_dense: int = 50,
        manual_seed: Optional[int] = None,
        num_batches: Optional[int] = None,
        num_generated_batches: int = 10,
        min_ids_per_feature: Optional[int] = None,
        min_ids_per_features: Optional[List[int]] = None,
    ) -> None:
        super().__init__()
        self.keys, self.batch_size, self.num_dense = list(keys), batch_size, num_dense
        self.hash_sizes = _per_key("hash_sizes", hash_size, hash_sizes, 100, self.keys)
        self.max_ids = _per_key("ids_per_features", ids_per_feature, ids_per_features, 2, self.keys)
        min_default = ids_per_feature if min_ids_per_feature is None else min_ids_per_feature
        self.min_ids = _per_key("min_ids_per_features", min_default, min_ids_per_features, 0, self.keys)
        bad = [k for k, lo, hi in zip(self.keys, self.min_ids, self.max_ids) if not 0 <= lo <= hi]
        if bad:
            raise ValueError(f"RandomRecDataset: keys {bad} need 0 <= min ids <= ids per feature")
        self.num_batches = num_batches
        self._generator = None if manual_seed is None else torch.Generator().manual_seed(manual_seed)
        self._cached = [self._generate() for _ in range(max(num_generated_batches, 0))]
        self._fresh = num_generated_batches < 0

    def __iter__(self) -> Iterator[Batch]:
        index = 0
        while self.num_batches is None or index < self.num_batches:
            yield self._generate() if self._fresh else self._cached[index % len(self._cached)]
            index += 1

    def _generate(self) -> Batch:
        gen, b = self._generator, self.batch_size
        lengths = [
            torch.randint(lo, hi + 1, (b,), dtype=torch.int32, generator=gen)
            for lo, hi in zip(self.min_ids, self.max_ids)
        ]
        values = [
            torch.randint(0, n, (int(bags.sum()),), generator=gen)
            for n, bags in zip(self.hash_sizes, lengths)
        ]
        kjt = KeyedJaggedTensor.from_lengths_sync(self.keys, torch.cat(values), torch.cat(lengths))
        dense = torch.randn(b, self.num_dense, generator=gen)
        labels = torch.randint(0, 2, (b,), generator=gen)
        return Batch(dense, kjt, labels)
