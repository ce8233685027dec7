"""torchrec's ``torchrec.distributed.mc_modules`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.sharding.mc_modules import (
    ManagedCollisionCollectionAwaitable,
    ManagedCollisionCollectionContext,
    ManagedCollisionCollectionSharder,
    ShardedManagedCollisionCollection,
    create_mc_sharding,
)

__all__ = [
    "ManagedCollisionCollectionAwaitable",
    "ManagedCollisionCollectionContext",
    "ManagedCollisionCollectionSharder",
    "ShardedManagedCollisionCollection",
    "create_mc_sharding",
]
