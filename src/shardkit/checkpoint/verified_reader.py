"""A ``torch.distributed.checkpoint`` storage reader with shardkit's checks, for raw ``dcp.load``.

``dcp.load(state, storage_reader=VerifiedFileSystemReader(path))`` reads a checkpoint written by
:func:`shardkit.checkpoint.save` into ``state`` (the same nested dict that save wrote:
``{"model": model.state_dict(), "optim": ...}``, or any part of it), on every rank, with:

- the manifest read and checked (``manifest.json``: format, file list);
- ``.metadata`` compared with the manifest's size and SHA-256, then unpickled from the same bytes
  with the restricted unpickler and bounded (``safe_metadata``, ``metadata_bounds``); its storage
  entries may only point inside the files the manifest lists;
- the data files this rank's plan reads verified (size and SHA-256) before any of them is read, so a
  truncated, flipped or missing file is dcp's ``CheckpointException`` on every rank (naming the file)
  before anything is written into ``state``;
- non-tensor records read without running code (``safe_records``).

Unlike :func:`shardkit.checkpoint.load`, ``dcp.load`` writes into ``state``'s tensors as it reads
(no staging copy): a failure while reading (a file changed after it was verified, a rank dying)
can leave them partly overwritten.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Dict

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan

from shardkit.checkpoint.manifest import CheckpointError, read_manifest, verify_files
from shardkit.checkpoint.metadata_bounds import UnsafeMetadataError, check_storage_files
from shardkit.checkpoint.safe_metadata import (
    MAX_METADATA_BYTES,
    METADATA_FILE,
    SafeFileSystemReader,
    read_metadata_bytes,
)

# one line per problem in an error; more are counted, not quoted
_MAX_LINES = 8


class VerifiedFileSystemReader(SafeFileSystemReader):
    """:class:`SafeFileSystemReader` for a shardkit checkpoint directory ``path``, verified against its
    manifest (see the module doc). Errors are ``CheckpointError`` / ``UnsafeMetadataError`` naming the
    file, raised by dcp as its ``CheckpointException`` on every rank."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._files: Dict[str, Dict[str, Any]] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeMetadataError(f"{self.path}: rank-local metadata files are not supported")
        directory = str(self.path)
        self._files = read_manifest(directory)["files"]
        path = os.path.join(directory, METADATA_FILE)
        expected = self._files.get(METADATA_FILE)
        if expected is None:
            raise CheckpointError(f"{os.path.join(directory, 'manifest.json')}: lists no {METADATA_FILE}")
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing")
        if expected["bytes"] > MAX_METADATA_BYTES:
            raise UnsafeMetadataError(
                f"{path}: the manifest says {expected['bytes']} bytes, more than a metadata file can hold"
            )
        # read once, check that very content, then unpickle it (no window to swap the file between)
        with open(path, "rb") as f:
            data = f.read(min(expected["bytes"], MAX_METADATA_BYTES) + 1)
        if len(data) != expected["bytes"]:
            raise CheckpointError(
                f"{path}: the manifest says {expected['bytes']} bytes (truncated or replaced)"
            )
        if hashlib.sha256(data).hexdigest() != expected["sha256"]:
            raise CheckpointError(
                f"{path}: checksum mismatch (the file was corrupted or modified after the save)"
            )
        metadata = read_metadata_bytes(data, path)
        check_storage_files(metadata, self._files, path)
        return self._with_load_id(metadata)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Verify the files this rank's plan reads, before any rank reads anything (dcp gathers the
        local plans, and their errors, first)."""
        names = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        problems = verify_files(str(self.path), self._files, names)
        if problems:
            more = f"\n... and {len(problems) - _MAX_LINES} more" if len(problems) > _MAX_LINES else ""
            raise CheckpointError("\n".join(problems[:_MAX_LINES]) + more)
        return super().prepare_local_plan(plan)


__all__ = ["VerifiedFileSystemReader"]
