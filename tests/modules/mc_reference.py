"""A slow plain-Python model of MCHManagedCollisionModule (docs/managed_collision.md), for the tests.

Each bucket is a list of ``S`` slot records ``[id or None, counts, last_access_iter]``; the last
record is the miss slot. Nothing here is vectorized or shares code with the module.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

INF = float("inf")


class ReferenceMCH:
    def __init__(
        self,
        zch_size: int,
        buckets: int,
        policy: str,  # "lfu", "lru" or "dlfu"
        interval: int,
        input_hash_size: int,
        decay: float = 1.0,
        threshold: Optional[Callable] = None,
    ) -> None:
        self.size = zch_size // buckets
        self.buckets, self.policy, self.interval, self.decay = buckets, policy, interval, decay
        self.id_range = -(-input_hash_size // buckets)
        self.threshold = threshold
        self.slots = [[[None, 0, 0] for _ in range(self.size)] for _ in range(buckets)]
        self.history: List[List[tuple]] = [[] for _ in range(buckets)]
        self.iteration = 0
        self.evicted: List[int] = []

    def score(self, counts: int, last: int) -> float:
        distance = float(self.iteration - last + 1) ** self.decay
        if self.policy == "lfu":
            return float(counts)
        if self.policy == "lru":
            return -distance
        return float(counts) / distance

    def profile(self, ids: List[int]) -> None:
        self.iteration += 1
        for i in ids:
            self.history[i // self.id_range].append((i, self.iteration))
        if self.iteration % self.interval == 0:
            for b in range(self.buckets):
                self.evict_bucket(b)

    def evict_bucket(self, b: int) -> None:
        window: Dict[int, List[int]] = {}
        for i, it in self.history[b]:
            entry = window.setdefault(i, [0, 0])
            entry[0] += 1
            entry[1] = max(entry[1], it)
        self.history[b] = []
        ids = sorted(window)
        if self.threshold is not None:
            mask = self.threshold(torch.tensor([window[i][0] for i in ids], dtype=torch.int64))[0].tolist()
            ids = [i for i, keep in zip(ids, mask) if keep]
        slots = self.slots[b]
        where = {rec[0]: j for j, rec in enumerate(slots) if rec[0] is not None}
        new = []
        for i in ids:
            if i in where:
                rec = slots[where[i]]
                rec[1] += window[i][0]
                rec[2] = window[i][1]
            else:
                new.append(i)
        new.sort(key=lambda i: (-window[i][0], i))
        # existing entries by ascending id, empty slots after them in slot order, the miss slot last
        existing = sorted(range(self.size - 1), key=lambda j: (slots[j][0] is None, slots[j][0] or 0, j))
        existing.append(self.size - 1)
        candidates = [
            ("slot", j, INF if j == self.size - 1 else self.score(slots[j][1], slots[j][2])) for j in existing
        ]
        candidates += [("new", i, self.score(window[i][0], window[i][1])) for i in new]
        ranked = sorted(candidates, key=lambda c: -c[2])  # stable: ties keep candidate order
        kept, dropped = ranked[: self.size], ranked[self.size :]
        chosen = [c[1] for c in kept if c[0] == "new"]
        losers = [c[1] for c in dropped if c[0] == "slot"]
        assert len(chosen) == len(losers)
        for j, i in zip(losers, chosen):
            slots[j] = [i, window[i][0], window[i][1]]
            self.evicted.append(b * self.size + j)

    def remap(self, ids: List[int]) -> List[int]:
        out = []
        for i in ids:
            b = i // self.id_range
            hit = [j for j, rec in enumerate(self.slots[b]) if rec[0] == i]
            out.append(b * self.size + (hit[0] if hit else self.size - 1))
        return out

    def evict(self) -> Optional[List[int]]:
        if not self.evicted:
            return None
        out = sorted(set(self.evicted))
        self.evicted = []
        return out

    def id_to_slot(self) -> Dict[int, int]:
        return {
            rec[0]: b * self.size + j
            for b, slots in enumerate(self.slots)
            for j, rec in enumerate(slots)
            if rec[0] is not None
        }
