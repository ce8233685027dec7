"""The shared-memory exchange's files in their directory: removing one, and the leftovers of killed ranks."""

from __future__ import annotations

import os
import time
from typing import Optional

STALE_AFTER_S = 24 * 3600  # files older than this are leftovers of killed ranks (remove_stale_files)


def remove_file(path: str) -> None:
    """Unlink ``path``; one already gone is fine (a peer or a sweep removed it)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_stale_files(directory: str, now: Optional[float] = None) -> int:
    """Remove the exchange's files (``shardkit-x-*``) in ``directory`` older than :data:`STALE_AFTER_S`;
    how many.

    A file stays in the directory only until every peer has mapped it (then its maker unlinks it); one
    whose maker was killed first (SIGKILL, or torchrun's SIGTERM after a peer failed) stays for good. A
    file that old belongs to a group whose ranks gave up long ago (every wait ends at the group's
    timeout), so removing it can break no live exchange. Called at every group's set-up."""
    now = time.time() if now is None else now
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.startswith("shardkit-x-"):
            continue
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime > STALE_AFTER_S:
                os.unlink(entry.path)
                removed += 1
        except OSError:  # gone meanwhile (another rank's sweep), or not ours to remove
            pass
    return removed


def boot_id() -> str:
    """This boot's id ("" where unreadable): with the hostname, tells whether ranks share a /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


__all__ = ["STALE_AFTER_S", "boot_id", "remove_file", "remove_stale_files"]
