"""Where each piece of a sharded parameter lives: ``ShardMetadata`` and ``EnumerableShardingSpec``.

A table of ``[rows, cols]`` is cut into rectangular shards; each shard names its offsets, sizes and
the rank that holds it. A valid spec tiles the table exactly (no gap, no overlap), which
:meth:`EnumerableShardingSpec.check` verifies without communication, so a sharder can reject a bad
plan on every rank before the first collective.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import List, Sequence

_PLACEMENT = re.compile(r"^rank:(\d+)(/.*)?$")


@dataclasses.dataclass(frozen=True)
class ShardMetadata:
    """One shard: ``shard_sizes`` elements starting at ``shard_offsets`` (one entry per dimension).

    ``placement`` follows torch's spelling ``"rank:<r>/<device>"`` (e.g. ``"rank:1/cuda:1"``,
    ``"rank:0/cpu"``); :attr:`rank` parses the rank out of it.
    """

    shard_offsets: List[int]
    shard_sizes: List[int]
    placement: str

    def __post_init__(self) -> None:
        if len(self.shard_offsets) != len(self.shard_sizes):
            raise ValueError(
                f"ShardMetadata: shard_offsets {self.shard_offsets} and shard_sizes {self.shard_sizes} "
                f"have different lengths"
            )
        if any(o < 0 for o in self.shard_offsets) or any(s < 0 for s in self.shard_sizes):
            raise ValueError(
                f"ShardMetadata: negative offset or size in offsets {self.shard_offsets}, "
                f"sizes {self.shard_sizes}"
            )
        if _PLACEMENT.match(str(self.placement)) is None:
            raise ValueError(
                f"ShardMetadata: placement {self.placement!r} is not of the form 'rank:<r>/<device>'"
            )

    @property
    def rank(self) -> int:
        """The rank that holds this shard."""
        return int(_PLACEMENT.match(str(self.placement)).group(1))

    @property
    def device(self) -> str:
        """The device part of the placement (``"cpu"`` when the placement names none)."""
        tail = _PLACEMENT.match(str(self.placement)).group(2)
        return tail[1:] if tail else "cpu"


@dataclasses.dataclass
class EnumerableShardingSpec:
    """A list of shards that together tile a parameter."""

    shards: List[ShardMetadata]

    def check(self, name: str, shape: Sequence[int], world_size: int) -> None:
        """Raise ``ValueError`` naming ``name`` unless the shards tile ``shape`` on ranks ``< world_size``.

        Checks: each shard has ``len(shape)`` dimensions and lies inside the table, its rank is in
        ``[0, world_size)``, no two shards overlap, and their volumes add up to the table's (which,
        without overlaps, means the table is covered).
        """
        shape = [int(s) for s in shape]
        for shard in self.shards:
            where = f"parameter {name!r}: shard at {shard.shard_offsets} of size {shard.shard_sizes}"
            if len(shard.shard_sizes) != len(shape):
                raise ValueError(f"{where} has {len(shard.shard_sizes)} dims, the table has {len(shape)}")
            if any(o + s > n for o, s, n in zip(shard.shard_offsets, shard.shard_sizes, shape)):
                raise ValueError(f"{where} does not fit the table of shape {shape}")
            if not 0 <= shard.rank < world_size:
                raise ValueError(f"{where} is placed on rank {shard.rank}, outside a world of {world_size}")
        for i, a in enumerate(self.shards):
            for b in self.shards[i + 1 :]:
                if _overlap(a, b):
                    raise ValueError(
                        f"parameter {name!r}: shards at {a.shard_offsets} (size {a.shard_sizes}) and "
                        f"{b.shard_offsets} (size {b.shard_sizes}) overlap"
                    )
        covered = sum(math.prod(s.shard_sizes) for s in self.shards)
        if covered != math.prod(shape):
            raise ValueError(
                f"parameter {name!r}: shards cover {covered} of the {math.prod(shape)} elements of a "
                f"table of shape {shape}"
            )


def _overlap(a: ShardMetadata, b: ShardMetadata) -> bool:
    return all(
        oa < ob + sb and ob < oa + sa
        for oa, sa, ob, sb in zip(a.shard_offsets, a.shard_sizes, b.shard_offsets, b.shard_sizes)
    ) and all(s > 0 for s in (*a.shard_sizes, *b.shard_sizes))


__all__ = ["EnumerableShardingSpec", "ShardMetadata"]
