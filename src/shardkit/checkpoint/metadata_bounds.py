"""Bounds on what a checkpoint's ``.metadata`` may describe, checked before a load plans anything.

A ``.metadata`` that unpickles into DCP's own classes can still describe work out of all proportion
to the model: one chunk repeated 40,000 times per tensor (a 484 KB file through pickle's memo) makes
every rank read each tensor 40,000 times. A checkpoint that DCP wrote describes every tensor as an
exact tiling (each element saved once, by one chunk), so :func:`check_metadata` requires, per tensor:

- at most ``MAX_CHUNKS_PER_TENSOR`` chunks (``MAX_CHUNKS`` over the file): a DCP save writes one chunk
  per saved shard, i.e. at most (saving ranks) x (column blocks per rank) per table;
- every chunk inside the tensor's shape (offsets and sizes non-negative, ``offset + size <= dim``);
- the non-empty chunks cover the tensor exactly: their volumes add up to its number of elements and
  no two overlap (checked on the grid of the chunks' boundaries, at most ``MAX_GRID_CELLS`` cells).

A load then reads each element of a tensor it asks for once, as a model of that shape needs
(DCP itself refuses a saved size different from the model's tensor). Every chunk and non-tensor
record has a storage entry, at most one each, and the entries must be plain file-slice descriptions
without transforms (``_StorageInfo``: a file name without a directory, non-negative offset and
length); :func:`check_storage_files` additionally ties them to the files a manifest lists, within
their sizes.
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

MAX_CHUNKS_PER_TENSOR = 1 << 16
MAX_CHUNKS = 1 << 20
MAX_GRID_CELLS = 1 << 22


class UnsafeMetadataError(ValueError):
    """A checkpoint's ``.metadata`` (or a record it points to) is not what a DCP save writes: it refers
    to other classes, is unreadable, or describes more than a checkpoint can hold."""


def _ints(values: Any) -> bool:
    return isinstance(values, Sequence) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    )


def _check_tensor(fqn: str, entry: TensorStorageMetadata, where: str) -> int:
    """Check one tensor's chunks (see the module doc); returns its number of chunks."""
    size = entry.size
    chunks = entry.chunks
    if not _ints(size) or any(d < 0 for d in size):
        raise UnsafeMetadataError(f"{where}: tensor {fqn!r} has an invalid shape {size!r}")
    if not isinstance(chunks, list):
        raise UnsafeMetadataError(f"{where}: tensor {fqn!r}: its chunks are not a list")
    if len(chunks) > MAX_CHUNKS_PER_TENSOR:
        raise UnsafeMetadataError(
            f"{where}: tensor {fqn!r} of shape {tuple(size)} is described by {len(chunks)} chunks, more "
            f"than a checkpoint writes ({MAX_CHUNKS_PER_TENSOR}): the file is corrupted or crafted"
        )
    numel = math.prod(size)
    ndim = len(size)
    covered = 0
    boxes: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = []
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not (_ints(offsets) and _ints(sizes) and len(offsets) == ndim and len(sizes) == ndim) or any(
            o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, size)
        ):
            raise UnsafeMetadataError(
                f"{where}: tensor {fqn!r} of shape {tuple(size)} has a chunk at offsets {offsets!r} of "
                f"sizes {sizes!r}, outside the tensor: the file is corrupted or crafted"
            )
        volume = math.prod(sizes)
        if volume:
            covered += volume
            boxes.append((tuple(offsets), tuple(sizes)))
        if covered > numel:
            raise UnsafeMetadataError(
                f"{where}: the chunks of tensor {fqn!r} (shape {tuple(size)}) describe more than its "
                f"{numel} elements (repeated or overlapping chunks): the file is corrupted or crafted"
            )
    if covered != numel:
        raise UnsafeMetadataError(
            f"{where}: the chunks of tensor {fqn!r} (shape {tuple(size)}) cover {covered} of its {numel} "
            "elements: the file is corrupted or crafted"
        )
    if len(boxes) > 1:
        _check_disjoint(fqn, tuple(size), boxes, where)
    return len(chunks)


def _check_disjoint(
    fqn: str, size: Tuple[int, ...], boxes: List[Tuple[Tuple[int, ...], Tuple[int, ...]]], where: str
) -> None:
    """No two of ``boxes`` overlap: each cell of the grid their boundaries cut the tensor into is in
    at most one box (together with the volume check: exactly one)."""
    cuts = [
        sorted({0, d} | {o[i] for o, _ in boxes} | {o[i] + s[i] for o, s in boxes})
        for i, d in enumerate(size)
    ]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > MAX_GRID_CELLS:
        raise UnsafeMetadataError(
            f"{where}: the {len(boxes)} chunks of tensor {fqn!r} (shape {size}) do not form a grid of at "
            f"most {MAX_GRID_CELLS} cells, unlike any sharding plan's: the file is corrupted or crafted"
        )
    count = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.int32)
    for offsets, sizes in boxes:
        index = tuple(
            slice(bisect.bisect_left(c, o), bisect.bisect_left(c, o + s))
            for c, o, s in zip(cuts, offsets, sizes)
        )
        count[index] += 1
    if int(count.max()) > 1:
        raise UnsafeMetadataError(
            f"{where}: chunks of tensor {fqn!r} (shape {size}) overlap: the file is corrupted or crafted"
        )


def check_metadata(metadata: Metadata, where: str) -> None:
    """Raise ``UnsafeMetadataError`` naming ``where`` and the tensor when ``metadata`` describes more
    than a DCP save writes (see the module doc)."""
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise UnsafeMetadataError(f"{where}: the metadata's state_dict_metadata is not a dict")
    total = 0
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise UnsafeMetadataError(f"{where}: a state-dict key {fqn!r} that is not a string")
        if isinstance(entry, BytesStorageMetadata):
            total += 1
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeMetadataError(f"{where}: the entry {fqn!r} is a {type(entry).__name__}")
        total += _check_tensor(fqn, entry, where)
        if total > MAX_CHUNKS:
            raise UnsafeMetadataError(
                f"{where}: describes more than {MAX_CHUNKS} chunks: the file is corrupted or crafted"
            )
    storage = metadata.storage_data
    if not isinstance(storage, dict) or len(storage) > total:
        raise UnsafeMetadataError(
            f"{where}: the metadata's storage entries are not a dict of at most one entry per chunk"
        )
    for fqn, entry in entries.items():
        offsets = [None] if isinstance(entry, BytesStorageMetadata) else [c.offsets for c in entry.chunks]
        for offset in offsets:
            if MetadataIndex(fqn, offset) not in storage:
                raise UnsafeMetadataError(
                    f"{where}: the chunk of {fqn!r} at offsets {offset} has no storage entry (the file is "
                    "corrupted or crafted)"
                )
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise UnsafeMetadataError(
                f"{where}: a storage entry that is not a file slice ({type(info).__name__})"
            )
        name = info.relative_path
        if (
            not isinstance(name, str)
            or name in ("", ".", "..")
            or "/" in name
            or "\\" in name
            or not _ints([info.offset, info.length])
            or info.offset < 0
            or info.length < 0
            or info.transform_descriptors  # shardkit and DCP's default writer use none
        ):
            raise UnsafeMetadataError(
                f"{where}: the storage entry of {index.fqn!r} is not a plain slice of a checkpoint file "
                f"(file {name!r}, offset {info.offset!r}, length {info.length!r}, transforms "
                f"{info.transform_descriptors!r})"
            )


def check_storage_files(metadata: Metadata, files: Dict[str, Dict[str, Any]], where: str) -> None:
    """Every storage entry of (checked) ``metadata`` names a file of the manifest's ``files`` and lies
    within its size; ``UnsafeMetadataError`` naming the entry otherwise."""
    for index, info in metadata.storage_data.items():
        entry = files.get(info.relative_path)
        end = info.offset + info.length
        if entry is None or end > entry["bytes"]:
            raise UnsafeMetadataError(
                f"{where}: the record {index.fqn!r} points to bytes {info.offset}..{end} "
                f"of {info.relative_path!r}, "
                + (
                    "a file the manifest does not list"
                    if entry is None
                    else f"which has {entry['bytes']} bytes"
                )
            )


__all__ = [
    "MAX_CHUNKS",
    "MAX_CHUNKS_PER_TENSOR",
    "MAX_GRID_CELLS",
    "UnsafeMetadataError",
    "check_metadata",
    "check_storage_files",
]
