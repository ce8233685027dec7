"""Checkpoints of sharded models: atomic, verified, resharded at load (layer 4).

``save(dir, model, optimizers)`` and ``load(dir, model, optimizers)`` on every rank. The directory
is a ``torch.distributed.checkpoint`` (DCP) checkpoint plus ``manifest.json`` (per-file checksums,
plan, world size, versions), so torch's own tools read it; ``VerifiedFileSystemReader`` gives raw
``dcp.load`` the same checks. See docs/checkpoint.md.
"""

from shardkit.checkpoint.checkpointing import load, save
from shardkit.checkpoint.manifest import MANIFEST_FILE, CheckpointError, read_manifest
from shardkit.checkpoint.metadata_bounds import UnsafeMetadataError
from shardkit.checkpoint.safe_metadata import SafeFileSystemReader, read_metadata_file
from shardkit.checkpoint.verified_reader import VerifiedFileSystemReader

__all__ = [
    "MANIFEST_FILE",
    "CheckpointError",
    "SafeFileSystemReader",
    "UnsafeMetadataError",
    "VerifiedFileSystemReader",
    "load",
    "read_manifest",
    "read_metadata_file",
    "save",
]
