"""torchrec's ``torchrec.distributed.fbgemm_qcomm_codec`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.distributed.codecs import CommType, QCommsConfig, get_qcomm_codecs, get_qcomm_codecs_registry

__all__ = ["CommType", "QCommsConfig", "get_qcomm_codecs", "get_qcomm_codecs_registry"]
