"""Reading a checkpoint's ``.metadata`` without running code from it.

``torch.distributed.checkpoint``'s ``FileSystemReader`` reads ``.metadata`` with ``pickle.load``, which
runs whatever callable the file names: a crafted file executes code on every rank that loads it.
:class:`SafeFileSystemReader` reads it with an unpickler that only builds the handful of plain data
classes a DCP metadata file is made of (listed in ``_ALLOWED``) and refuses anything else, naming the
file and the refused name; what the metadata describes is then bounded (``metadata_bounds``). Tensor
records are read by torch with ``weights_only`` loading already; DCP's load planner unpickles the other
records (``torch.load(weights_only=False)``), so this reader loads those itself first
(``safe_records``).
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from shardkit.checkpoint.metadata_bounds import UnsafeMetadataError, check_metadata
from shardkit.checkpoint.safe_records import SafeRecordsPlanner

METADATA_FILE = ".metadata"
# a DCP metadata file describes chunks, not data: far below this even for huge models
MAX_METADATA_BYTES = 256 * 1024 * 1024

# (module, name) a DCP metadata pickle refers to (torch 2.13: dataclasses of the checkpoint's
# metadata, torch.Size, dtypes, the tensor layout helper, the file-system storage info, paths)
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, stream: Any, path: str) -> None:
        super().__init__(stream)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeMetadataError(
            f"{self._path}: refusing to load {module}.{name}: a DCP metadata file holds only checkpoint "
            "metadata classes (the file is corrupted or crafted)"
        )


def read_metadata_file(path: str) -> Metadata:
    """The ``Metadata`` in file ``path``, unpickled without running code and checked against
    :func:`~shardkit.checkpoint.metadata_bounds.check_metadata`; ``UnsafeMetadataError`` naming the
    file if it refers to anything but the checkpoint metadata classes, is not one, or describes more
    than a checkpoint can hold."""
    size = os.path.getsize(path)
    if size > MAX_METADATA_BYTES:
        raise UnsafeMetadataError(
            f"{path}: {size} bytes, more than a metadata file can hold ({MAX_METADATA_BYTES})"
        )
    with open(path, "rb") as f:
        data = f.read()
    return read_metadata_bytes(data, path)


def read_metadata_bytes(data: bytes, path: str) -> Metadata:
    """:func:`read_metadata_file` of the bytes ``data`` read from ``path`` (named in errors)."""
    if len(data) > MAX_METADATA_BYTES:
        raise UnsafeMetadataError(
            f"{path}: {len(data)} bytes, more than a metadata file can hold ({MAX_METADATA_BYTES})"
        )
    try:
        metadata = _RestrictedUnpickler(io.BytesIO(data), path).load()
    except UnsafeMetadataError:
        raise
    except Exception as err:  # noqa: BLE001 - any unpickling failure means a bad file; say which
        raise UnsafeMetadataError(f"{path}: not a readable DCP metadata file ({type(err).__name__})") from err
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadataError(f"{path}: holds a {type(metadata).__name__}, not a DCP Metadata")
    check_metadata(metadata, path)
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` that runs no code from the checkpoint: ``.metadata`` is read by
    :func:`read_metadata_file` (restricted unpickling, bounded contents), and every non-tensor record
    (``BytesStorageMetadata``: a learning rate, a step count) by ``torch.load(weights_only=True)``
    before the planner sees it (``safe_records``). Any DCP checkpoint; no checksums (see
    :class:`~shardkit.checkpoint.verified_reader.VerifiedFileSystemReader`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # dcp asks for a rank-local ``__<rank>.metadata`` after the global one failed: shardkit
            # checkpoints have none, and the global file's error is the one to report
            raise UnsafeMetadataError(f"{self.path}: rank-local metadata files are not supported")
        metadata = read_metadata_file(os.path.join(str(self.path), METADATA_FILE))
        return self._with_load_id(metadata)

    def _with_load_id(self, metadata: Metadata) -> Metadata:
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return super().read_data(plan, SafeRecordsPlanner(planner, str(self.path)))


__all__ = [
    "METADATA_FILE",
    "SafeFileSystemReader",
    "UnsafeMetadataError",
    "read_metadata_bytes",
    "read_metadata_file",
]
