"""The manifest of a shardkit checkpoint: what was saved, by whom, and a checksum of every file.

``manifest.json`` sits next to DCP's files and is written last, after every rank's files are complete,
so a directory with a manifest whose checksums match is a whole checkpoint. It holds::

    {"format": "shardkit-checkpoint", "format_version": 1, "shardkit_version": "...",
     "torch_version": "...", "world_size": N, "plan": {...} or null,
     "files": {"<name>": {"bytes": n, "sha256": "<hex>"}}}

The checksum work is split over the ranks (rank ``r`` hashes files ``r, r + world, ...``); the
callers gather the results.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Sequence

import torch

import shardkit

MANIFEST_FILE = "manifest.json"
FORMAT = "shardkit-checkpoint"
FORMAT_VERSION = 1
# a manifest lists files and a plan summary; anything larger is not one of ours
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
_BLOCK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message names the directory and the file at fault."""


def file_digest(path: str) -> Dict[str, Any]:
    """``{"bytes": size, "sha256": hex}`` of the file at ``path``, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_BLOCK)
            if not block:
                break
            size += len(block)
            digest.update(block)
    return {"bytes": size, "sha256": digest.hexdigest()}


def my_share(names: Sequence[str], rank: int, world_size: int) -> List[str]:
    """The files this rank hashes or verifies: every ``world_size``-th name from ``rank`` on."""
    return list(sorted(names))[rank::world_size]


def build_manifest(files: Dict[str, Dict[str, Any]], world_size: int, plan: Optional[Any]) -> Dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "shardkit_version": shardkit.__version__,
        "torch_version": torch.__version__,
        "world_size": world_size,
        "plan": plan,
        "files": dict(sorted(files.items())),
    }


def write_manifest(directory: str, manifest: Dict[str, Any]) -> None:
    """Write ``manifest.json`` durably (a temporary name, fsync, rename)."""
    path = os.path.join(directory, MANIFEST_FILE)
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, default=str)  # a plan value JSON lacks is written as text
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_directory(directory)


def fsync_directory(directory: str) -> None:
    """Make a rename or a new file in ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_manifest(directory: str) -> Dict[str, Any]:
    """The checked manifest of the checkpoint in ``directory``; ``CheckpointError`` naming what is wrong."""
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path}: missing: {directory} is not a shardkit checkpoint, or its save did not finish"
        )
    size = os.path.getsize(path)
    if size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path}: {size} bytes, too large for a manifest")
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable manifest ({str(err)[:200]})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a shardkit checkpoint manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {manifest.get('format_version')!r}; this shardkit reads {FORMAT_VERSION}"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(_is_entry(name, entry) for name, entry in files.items()):
        raise CheckpointError(f"{path}: malformed file list")
    return manifest


def _is_entry(name: Any, entry: Any) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and isinstance(entry, dict)
        and isinstance(entry.get("bytes"), int)
        and isinstance(entry.get("sha256"), str)
    )


def verify_files(directory: str, files: Dict[str, Dict[str, Any]], names: Sequence[str]) -> List[str]:
    """Problems with the given ``names`` of the manifest's ``files`` (missing, wrong size, wrong
    checksum), one line each naming the file; empty when they are intact."""
    problems = []
    for name in names:
        path = os.path.join(directory, name)
        expected = files[name]
        if not os.path.isfile(path):
            problems.append(f"{path}: missing")
            continue
        size = os.path.getsize(path)
        if size != expected["bytes"]:
            problems.append(
                f"{path}: {size} bytes, the manifest says {expected['bytes']} (truncated or replaced)"
            )
            continue
        if file_digest(path)["sha256"] != expected["sha256"]:
            problems.append(f"{path}: checksum mismatch (the file was corrupted or modified after the save)")
    return problems


__all__ = [
    "MANIFEST_FILE",
    "CheckpointError",
    "build_manifest",
    "file_digest",
    "fsync_directory",
    "my_share",
    "read_manifest",
    "verify_files",
    "write_manifest",
]
