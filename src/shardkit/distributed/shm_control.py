"""The control block of a group's shared-memory exchange: its fence, read-done marks and statuses.

One small file per group in ``/dev/shm`` (made by group rank 0 when the group's exchange is set up,
mapped by every rank, then unlinked), of int64 words. Each rank writes only its own region and reads
the others'::

    region of rank r (a whole number of 64-byte lines):
      [0] published: how many calls this rank has published (call n is published when it is >= n + 1)
      [1] done:      how many calls this rank has completed (read every peer's bytes of)
      [2] state:     0 while the rank is in the exchange; LEFT (an error) or CLOSED once it left
      [3] bell:      incremented after each of the words above changes (a futex: waiters sleep on it)
      [4] sleeping:  1 + the rank whose bell this rank sleeps on, 0 while awake (rings skip the
                     wake-up call when no peer sleeps on them)
      then ENTRIES entries (call n uses entry n % ENTRIES), each 5 + 3W words:
      [0] n + 1  [1] status (OK / NO_SPACE)  [2] data buffer  [3] its generation  [4] its size
      [5 : 5 + W] bytes for each rank  [5 + W : 5 + 2W] where they start in the buffer
      [5 + 2W : 5 + 3W] bytes expected from each rank

A rank publishes call n by writing the entry and then, last, ``published = n + 1``; a reader that
sees ``published >= n + 1`` reads the entry and the data after it. Memory ordering: this is done with
plain stores and loads from Python (``memoryview`` items: one aligned 8-byte ``mov`` each), which is
correct only where the CPU keeps stores in order and loads in order (x86-64's TSO; torch's copies,
multi-threaded or not, end before the Python store that follows them). :data:`STRONGLY_ORDERED` says
whether this machine is one; elsewhere the exchange is not used (gloo carries the bytes).

Waiting (:meth:`Control.wait_for`) polls the peers' words for a few microseconds, then sleeps in the
kernel on the lagging peer's bell (a shared futex, through ``ctypes``: the waker's kernel call wakes
it, as a socket's data wakes gloo's reader; a core is never burnt while the peers compute), or, where
``futex`` cannot be called (``SHARDKIT_SHM_FUTEX=0``), in sleeps growing to 1 ms. Every wait ends at
a deadline with a :class:`~shardkit.distributed.timeouts.CollectiveTimeoutError` naming the ranks
whose word did not arrive.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct
import time
from typing import List, Optional, Sequence

from shardkit.distributed.timeouts import PeerWaitTimeoutError

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE_FLAG): the word is in another process too
_SYS_FUTEX = {"x86_64": 202, "amd64": 202}.get(platform.machine().lower())


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _make_futex():
    """``futex(address, op, value, timeout_s)`` through libc's ``syscall``, or None where unavailable."""
    if _SYS_FUTEX is None or os.environ.get("SHARDKIT_SHM_FUTEX", "1") == "0":
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long

    def futex(address: int, op: int, value: int, timeout_s: Optional[float]) -> int:
        spec = None
        if timeout_s is not None:
            timeout_s = max(timeout_s, 0.0)
            spec = ctypes.byref(_Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9)))
        return syscall(
            ctypes.c_long(_SYS_FUTEX),
            ctypes.c_void_p(address),
            ctypes.c_int(op),
            ctypes.c_int(value),
            spec,
            None,
            0,
        )

    return futex


_futex = _make_futex()

# plain stores and loads are ordered (TSO) only on x86: elsewhere the exchange is off (gloo)
STRONGLY_ORDERED = platform.machine().lower() in ("x86_64", "amd64")
ENTRIES = 32  # calls whose entries a rank keeps; call n reuses call n - ENTRIES's entry
PUBLISHED, DONE, STATE, BELL, SLEEPING = 0, 1, 2, 3, 4
HEAD = 8  # words before the entries (one 64-byte line)
OK, NO_SPACE = 0, 1  # an entry's status
LEFT, CLOSED = 1, 2  # a rank's state: left with an error; closed its exchange (or exited)
_SPIN = 64  # polls before sleeping
_SLEEP_MAX_S = 1e-3  # without futex
_FUTEX_SLICE_S = 0.005  # a futex sleep at most this long (then the deadline and the words again)


def entry_words(world: int) -> int:
    return 5 + 3 * world


def region_words(world: int) -> int:
    words = HEAD + ENTRIES * entry_words(world)
    return (words + 7) // 8 * 8


def control_bytes(world: int) -> int:
    return 8 * world * region_words(world)


def reserve(fd: int, nbytes: int) -> None:
    """Reserve ``nbytes`` of the file behind ``fd`` (``OSError`` when ``/dev/shm`` lacks the space):
    without it, a store past a tmpfs's limit through a mapping would kill the process (SIGBUS)."""
    os.posix_fallocate(fd, 0, nbytes)


def map_file(path: str, nbytes: int, create: bool) -> mmap.mmap:
    """Map ``nbytes`` of ``path`` shared, creating and reserving it when ``create`` (``OSError`` when
    that fails; the file is then removed)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            try:
                reserve(fd, nbytes)
            except OSError:
                os.unlink(path)
                raise
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


class Control:
    """This rank's view of the group's control block (``words``: the whole file as int64 items)."""

    def __init__(self, mapping: mmap.mmap, rank: int, world: int, global_ranks: Sequence[int]) -> None:
        self.mapping = mapping
        self.words = memoryview(mapping).cast("q")
        self.rank, self.world = rank, world
        self.global_ranks = list(global_ranks)
        self.region = region_words(world)
        self.entry = entry_words(world)
        self.me = rank * self.region
        self.peers = [r for r in range(world) if r != rank]
        self._entry = struct.Struct(f"{4 + 3 * world}q")  # an entry after its call number
        self._anchor = None  # the ctypes view whose address is the mapping's (held: it pins the address)
        self._base: Optional[int] = None
        if _futex is not None:
            self._anchor = ctypes.c_char.from_buffer(mapping)
            self._base = ctypes.addressof(self._anchor)

    # --- this rank's words
    def entry_base(self, rank: int, call: int) -> int:
        return rank * self.region + HEAD + (call % ENTRIES) * self.entry

    def publish(
        self, call: int, status: int, buffer: int, generation: int, size: int, header: List[int]
    ) -> None:
        """Write call ``call``'s entry (``header``: sizes, starts, expected sizes: 3W ints), then, last,
        ``published = call + 1``."""
        base = self.entry_base(self.rank, call)
        words = self.words
        self._entry.pack_into(self.mapping, 8 * (base + 1), status, buffer, generation, size, *header)
        words[base] = call + 1
        words[self.me + PUBLISHED] = call + 1
        self._ring()

    def mark_done(self, call: int) -> None:
        self.words[self.me + DONE] = call + 1
        self._ring()

    def mark_left(self, state: int = LEFT) -> None:
        self.words[self.me + STATE] = state
        self._ring()

    def _ring(self) -> None:
        """After a word changed: the bell moves (stored after the word), waiters sleeping on it wake."""
        words, region, me = self.words, self.region, self.rank + 1
        words[self.me + BELL] += 1  # only this rank writes it
        if self._base is not None:
            for r in self.peers:
                if words[r * region + SLEEPING] == me:
                    _futex(self._base + 8 * (self.me + BELL), _FUTEX_WAKE, 0x7FFFFFFF, None)
                    break

    # --- the peers' words
    def read_entry(self, rank: int, call: int) -> List[int]:
        """``[status, buffer, generation, size, *sizes, *starts, *expected]`` of ``rank``'s call ``call``."""
        return self._entry.unpack_from(self.mapping, 8 * (self.entry_base(rank, call) + 1))

    def done_of(self, rank: int) -> int:
        return self.words[rank * self.region + DONE]

    def reached(self, word: int, at_least: int) -> bool:
        """Whether every peer's ``word`` is ``>= at_least``."""
        words, region = self.words, self.region
        for r in self.peers:
            if words[r * region + word] < at_least:
                return False
        return True

    def lagging(self, word: int, at_least: int) -> List[int]:
        """The peers whose ``word`` is below ``at_least``."""
        words, region = self.words, self.region
        return [r for r in self.peers if words[r * region + word] < at_least]

    def left(self) -> List[int]:
        """The peers that left the exchange (with an error, or closed it)."""
        words, region = self.words, self.region
        return [r for r in self.peers if words[r * region + STATE]]

    def wait_for(self, word: int, at_least: int, deadline: float, what: str, call: int) -> None:
        """Until every peer's ``word`` is ``>= at_least``; ``CollectiveTimeoutError`` at ``deadline``
        (``time.monotonic()``) or when a peer left with an error, naming those peers."""
        words, region, peers = self.words, self.region, self.peers
        polls, sleep = 0, 2e-5
        while True:
            lag = next((r for r in peers if words[r * region + word] < at_least), None)
            if lag is None:
                return
            polls += 1
            if polls < _SPIN:
                continue
            left = self.left()
            now = time.monotonic()
            if left or now >= deadline:
                raise self.timeout_error(word, at_least, what, call, left)
            if self._base is None:
                time.sleep(sleep)
                sleep = min(2 * sleep, _SLEEP_MAX_S)
                continue
            # sleeping first, then the bell, then the word: a ring after the word was read changes the
            # bell, and the kernel compares it before sleeping. The ringer reads ``sleeping`` without
            # a fence (none in Python): it may miss a sleeper by the nanoseconds its store takes to
            # leave the store buffer, which the kernel's comparison almost always sees; at worst the
            # sleeper wakes at the end of its slice
            words[self.me + SLEEPING] = lag + 1
            bell = words[lag * region + BELL]
            if words[lag * region + word] < at_least:
                seconds = min(deadline - now, _FUTEX_SLICE_S)
                expected = (bell & 0xFFFFFFFF) - ((bell & 0x80000000) << 1)  # its low 32 bits, signed
                _futex(self._base + 8 * (lag * region + BELL), _FUTEX_WAIT, expected, seconds)
            words[self.me + SLEEPING] = 0

    def timeout_error(self, word: int, at_least: int, what: str, call: int, left: List[int]) -> Exception:
        missing = [r for r in self.lagging(word, at_least) if r not in left]
        name = "publish" if word == PUBLISHED else "finish reading"

        def named(ranks: List[int]) -> str:
            shown = [f"{r} (global {self.global_ranks[r]})" for r in ranks]
            return "[" + ", ".join(shown) + "]"

        found = []
        if missing:
            found.append(f"rank(s) {named(missing)} did not {name} call {at_least - 1} in time")
        failed = [r for r in left if self.words[r * self.region + STATE] == LEFT]
        closed = [r for r in left if r not in failed]
        if failed:
            found.append(f"rank(s) {named(failed)} left the exchange with an error of their own")
        if closed:
            found.append(f"rank(s) {named(closed)} closed the exchange (or exited) before this call")
        return PeerWaitTimeoutError(
            f"shared-memory exchange, rank {self.rank} (global {self.global_ranks[self.rank]}) of a group "
            f"of {self.world}, {what} of call {call}: " + "; ".join(found) + " (the group's timeout is set "
            "by init_process_group / new_group(timeout=...) or SHARDKIT_TIMEOUT)"
        )

    def close(self) -> None:
        self._anchor = self._base = None
        self.words.release()
        try:
            self.mapping.close()
        except BufferError:  # a view still exported: the mapping goes with its last reference
            pass


def deadline_after(seconds: Optional[float]) -> float:
    return time.monotonic() + (seconds if seconds is not None else 1800.0)


__all__ = ["Control", "STRONGLY_ORDERED", "control_bytes", "map_file", "reserve"]
