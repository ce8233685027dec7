"""An all-to-all between the CPU ranks of one host through shared memory instead of gloo's loopback TCP.

Opt-in: ``SHARDKIT_SHM_EXCHANGE=1`` (or :func:`set_shm_exchange`), read by
:func:`shardkit.distributed.direct_collectives.all_to_all_single`, which the comm ops and the KJT
all-to-all call. It must agree between the ranks (a rank on gloo and one on shared memory would hang):
it is one of :func:`shardkit.distributed.switches.result_switches`.

Why: gloo moves an all-to-all's bytes through loopback TCP; on the 2-core test machine 4 MiB per peer
took 2.4-4.0 ms where a copy of them takes 0.4 ms (docs/performance.md, "What the ranks wait on").

How, per call (``W`` ranks of ``group``, all on this host): every rank has two shared files (in
``/dev/shm``, mapped by every rank of the group, unlinked once mapped) and alternates between them.
It copies its chunk for each other rank into its current file at the chunk's offset in its input; one
small all-gather of ``[generation, W + 1 send offsets]`` per rank is the fence: after it every rank
has written, and knows where its chunks lie in the others' files; each rank then copies its chunks
out into ``output`` (its own chunk straight from ``input``). Two files: a rank writes file ``b`` again
two calls later, after the fence of the call between, which every rank enters only once it has read
everything of the call before. A file too small for a send is replaced by a larger one (its
generation, in the fence, tells the peers to map the new one). The exchange completes when it
starts (no background thread): the returned work is already done.

Bytes are copied as they are: the result is bitwise gloo's.
"""

from __future__ import annotations

import atexit
import os
import socket
import uuid
import weakref
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from shardkit.distributed.state import register_reset

ENV = "SHARDKIT_SHM_EXCHANGE"
_enabled: Optional[bool] = None


def shm_exchange_enabled() -> bool:
    """Whether CPU all-to-alls of one-host gloo groups go through shared memory (default: off)."""
    global _enabled
    if _enabled is None:
        value = os.environ.get(ENV, "0")
        if value not in ("0", "1"):
            raise ValueError(f"{ENV}={value!r}: expected 0 or 1")
        _enabled = value == "1"
    return _enabled


def set_shm_exchange(enabled: bool) -> None:
    """Switch the shared-memory exchange on or off in this process (every rank must do the same)."""
    global _enabled
    _enabled = bool(enabled)


class _Done:
    """The work of an exchange that completed when it started."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _Done()


class SharedMemoryExchange:
    """The two shared files of this rank in ``group`` and its mappings of the other ranks' files."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.world = group.rank(), group.size()
        # a prefix unique to this group instance, the same on every rank (rank 0's, gathered)
        host = f"{socket.gethostname()}:{_boot_id()}"
        names: List[Optional[tuple]] = [None] * self.world
        dist.all_gather_object(names, (host, uuid.uuid4().hex[:12]), group=group)
        self.one_host = len({h for h, _ in names}) == 1
        self.prefix = f"/dev/shm/shardkit-x-{names[0][1]}"
        self._mine: List[Optional[torch.Tensor]] = [None, None]
        self._generation = [0, 0]
        self._peers: Dict[tuple, tuple] = {}  # (source rank, file) -> (generation, mapping)
        self._made: List[tuple] = []  # (call index, path) of files not unlinked yet
        self._calls = 0
        self._fence = torch.empty(self.world * (self.world + 3), dtype=torch.int64)

    def _path(self, rank: int, which: int, generation: int) -> str:
        return f"{self.prefix}-{rank}-{which}-{generation}"

    def _grow(self, which: int, nbytes: int, call: int) -> None:
        old = self._mine[which]
        size = max(nbytes, 1 << 20, 0 if old is None else 2 * old.numel())
        self._generation[which] += 1
        path = self._path(self.rank, which, self._generation[which])
        with open(path, "wb") as f:
            f.truncate(size)
        self._mine[which] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self._made.append((call, path))  # unlinked after the next call's fence: every peer mapped it

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: List[int], input_splits: List[int]
    ) -> _Done:
        """``output`` / ``input``: contiguous uint8; splits: bytes per rank. Completes before it returns."""
        call = self._calls
        which = call % 2
        self._calls += 1
        sent = [0]
        for n in input_splits:
            sent.append(sent[-1] + n)
        if sent[-1] > input.numel() or sum(output_splits) > output.numel():
            raise ValueError(
                f"shared-memory all-to-all on rank {self.rank}: splits {input_splits} / {output_splits} "
                f"exceed "
                f"the input ({input.numel()} bytes) / output ({output.numel()} bytes)"
            )
        mine = self._mine[which]
        if mine is None or mine.numel() < sent[-1]:
            self._grow(which, sent[-1], call)
            mine = self._mine[which]
        for r in range(self.world):
            if r != self.rank and input_splits[r]:
                mine[sent[r] : sent[r + 1]].copy_(input[sent[r] : sent[r + 1]])
        header = torch.tensor([self._generation[which], mine.numel(), *sent], dtype=torch.int64)
        _all_gather(self._fence, header, group=self.group)
        fence = self._fence.view(self.world, self.world + 3).tolist()
        for made, path in self._made:
            if made < call:
                _remove(path)
        self._made = [(made, path) for made, path in self._made if made == call]
        at = 0
        for s in range(self.world):
            n = output_splits[s]
            if s == self.rank:
                output[at : at + n].copy_(input[sent[s] : sent[s] + n])
            else:
                generation, size, offsets = fence[s][0], fence[s][1], fence[s][2:]
                if offsets[self.rank + 1] - offsets[self.rank] != n:
                    raise ValueError(
                        f"shared-memory all-to-all: rank {s} sends "
                        f"{offsets[self.rank + 1] - offsets[self.rank]} bytes to rank {self.rank}, which "
                        f"expects {n}"
                    )
                # mapped whenever its generation changes, bytes for this rank or not: the file is
                # unlinked after the next call's fence
                src = self._peer(s, which, generation, size)
                output[at : at + n].copy_(src[offsets[self.rank] : offsets[self.rank] + n])
            at += n
        return DONE

    def _peer(self, rank: int, which: int, generation: int, size: int) -> torch.Tensor:
        known = self._peers.get((rank, which))
        if known is None or known[0] != generation:
            mapping = torch.from_file(
                self._path(rank, which, generation), shared=True, size=size, dtype=torch.uint8
            )
            self._peers[(rank, which)] = known = (generation, mapping)
        return known[1]

    def close(self) -> None:
        for _, path in self._made:
            _remove(path)
        self._made = []
        self._mine = [None, None]
        self._peers.clear()


# torch 2.13 renamed all_gather_into_tensor (now deprecated, with a warning per call)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


_EXCHANGES: weakref.WeakKeyDictionary[dist.ProcessGroup, Optional[SharedMemoryExchange]] = (
    weakref.WeakKeyDictionary()
)


def exchange_for(group: dist.ProcessGroup) -> Optional[SharedMemoryExchange]:
    """The group's exchange (made on its first all-to-all: a collective), None where its ranks span hosts
    or its backend is not gloo."""
    try:
        return _EXCHANGES[group]
    except KeyError:
        pass
    exchange = None
    if "gloo" in str(dist.get_backend(group)) and group.size() > 1:
        exchange = SharedMemoryExchange(group)
        if not exchange.one_host:
            exchange = None
    _EXCHANGES[group] = exchange
    return exchange


def close_all() -> None:
    """Unlink this process's pending files and drop every mapping (tests; process exit)."""
    for exchange in list(_EXCHANGES.values()):
        if exchange is not None:
            exchange.close()
    _EXCHANGES.clear()


def _reset() -> None:
    """Back to the environment's setting, every exchange closed (``state.reset_all``)."""
    global _enabled
    close_all()
    _enabled = None


register_reset("shm_exchange", _reset)
atexit.register(close_all)  # files made in the last call are otherwise unlinked at the next one


__all__ = [
    "ENV",
    "SharedMemoryExchange",
    "close_all",
    "exchange_for",
    "set_shm_exchange",
    "shm_exchange_enabled",
]
