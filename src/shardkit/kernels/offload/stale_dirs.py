"""Owner records of default offload directories, and the sweep of those whose owner died.

The default offload directory of a process is removed at exit (``atexit``); a process that is killed
(SIGKILL, the OOM killer, a crashed node) never runs that clean-up, and its backing files, possibly many
GiB, would stay in the temporary directory forever. So each default directory carries a marker file,
:data:`MARKER`, recording its owner, and a process creating its own default directory first removes the
sibling default directories of the same user whose owner no longer exists (:func:`sweep_dead`).

The owner is a pid *and* that process's start time (field 22 of ``/proc/<pid>/stat``, clock ticks since
boot): a pid reused by another process has another start time, so it is not mistaken for the owner.
The marker also records the boot id, the host name and the pid namespace: after a reboot every old
owner is dead; a directory of another host (a shared temporary directory) or of another pid namespace
(a container sharing /tmp) cannot be judged from here and is left alone. Without ``/proc`` (not Linux)
nothing is ever swept.

Only a directory that is (not a link to) a directory named ``shardkit-offload-*``, owned by this user
and holding a well-formed marker owned by this user, is ever removed; a user-chosen offload directory is
never swept (its files may be wanted).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from typing import List, Optional, Tuple

DIR_PREFIX = "shardkit-offload-"
MARKER = ".shardkit-offload-owner"
_MARKER_MAX_BYTES = 4096


def process_start_time(pid: int) -> Optional[int]:
    """Start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None
    if it does not exist (or there is no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may itself hold spaces or ')': split after the last
    after = raw.rsplit(b")", 1)[-1].split()
    try:
        return int(after[19])  # fields 3.. follow the name: field 22 is the 20th of them
    except (IndexError, ValueError):
        return None


def _read_small(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return f.read().decode().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _boot_id() -> Optional[str]:
    return _read_small("/proc/sys/kernel/random/boot_id")


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _host() -> str:
    return os.uname().nodename if hasattr(os, "uname") else ""


def owner_record(pid: Optional[int] = None) -> dict:
    """What the marker of a directory owned by process ``pid`` (default: this one) records."""
    pid = os.getpid() if pid is None else pid
    return {
        "pid": pid,
        "start_time": process_start_time(pid),
        "boot_id": _boot_id(),
        "host": _host(),
        "pid_namespace": _pid_namespace(),
    }


def write_marker(directory: str, record: Optional[dict] = None) -> None:
    """Record this process (or ``record``) as the owner of ``directory`` (created just before)."""
    body = json.dumps(owner_record() if record is None else record, sort_keys=True).encode()
    fd = os.open(os.path.join(directory, MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, body)
    finally:
        os.close(fd)


def owner_is_dead(record: dict) -> bool:
    """True only if the owner recorded in ``record`` certainly no longer exists on this machine."""
    pid, start = record.get("pid"), record.get("start_time")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if record.get("host") != _host():
        return False  # another machine's directory: its processes are not visible from here
    boot = _boot_id()
    if boot is None or record.get("boot_id") is None:
        return False  # no /proc here or where the marker was written: cannot tell
    if record.get("boot_id") != boot:
        return True  # the machine rebooted since: every process of that boot is gone
    if record.get("pid_namespace") != _pid_namespace():
        return False  # another pid namespace (a container sharing /tmp): its pids mean other processes
    if not isinstance(start, int):
        return False
    # a missing process, or the pid now held by another process (another start time): the owner is gone
    return process_start_time(pid) != start


def _marked_record(path: str, uid: int) -> Optional[dict]:
    """The owner record of ``path`` if it is a real directory of ``uid`` with a well-formed marker of
    ``uid`` (a regular file, not a link), else None."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
        return None
    marker = os.path.join(path, MARKER)
    try:
        fd = os.open(marker, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        minfo = os.fstat(fd)
        if not stat.S_ISREG(minfo.st_mode) or minfo.st_uid != uid or minfo.st_size > _MARKER_MAX_BYTES:
            return None
        record = json.loads(os.read(fd, _MARKER_MAX_BYTES).decode())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    finally:
        os.close(fd)
    return record if isinstance(record, dict) else None


def _disk_bytes(path: str) -> int:
    """Bytes of disk the files under ``path`` occupy (allocated blocks: a reserved file counts whole)."""
    total = 0
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except (OSError, AttributeError):
                pass
    return total


def sweep_dead(parent: str, keep: Optional[str] = None) -> List[Tuple[str, int]]:
    """Remove the default offload directories in ``parent`` of this user whose owner is dead.

    Returns (path, bytes freed) for each removed directory and says so on stderr. ``keep`` (this
    process's own directory) is never touched; nor is anything without a well-formed marker of this
    user, nor a directory whose owner is alive or cannot be judged (:func:`owner_is_dead`).
    """
    uid = os.getuid() if hasattr(os, "getuid") else -1
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(parent, name)
        if not name.startswith(DIR_PREFIX):
            continue
        if keep is not None and os.path.abspath(path) == os.path.abspath(keep):
            continue
        record = _marked_record(path, uid)
        if record is None or not owner_is_dead(record):
            continue
        freed = _disk_bytes(path)
        # remove the marker last: a directory half-removed (a concurrent sweep, a crash) keeps its marker
        # until everything else is gone, so a later sweep finishes it
        try:
            entries = os.listdir(path)
        except OSError:
            continue
        for entry in entries:
            if entry == MARKER:
                continue
            target = os.path.join(path, entry)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target, ignore_errors=True)
            else:
                try:
                    os.unlink(target)
                except FileNotFoundError:
                    pass
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            continue  # not removable (another sweep got there, or a permission problem): say nothing
        removed.append((path, freed))
        print(
            f"shardkit: removed stale offload directory {path} of dead process {record.get('pid')} "
            f"({freed} bytes freed)",
            file=sys.stderr,
        )
    return removed
