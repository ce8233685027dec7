"""torchrec's ``torchrec.types`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.modules.embedding_configs import DataType

__all__ = ["DataType"]
