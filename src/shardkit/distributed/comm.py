"""torchrec's ``torchrec.distributed.comm`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.distributed.topology import (
    get_group_rank,
    get_local_rank,
    get_local_size,
    get_num_groups,
    intra_and_cross_node_pg,
)

__all__ = ["get_group_rank", "get_local_rank", "get_local_size", "get_num_groups", "intra_and_cross_node_pg"]
