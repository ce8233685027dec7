"""All-to-alls and all-reduces between the CPU ranks of one host through shared memory, not gloo's TCP.

On by default (:data:`DEFAULT_ENABLED`); ``SHARDKIT_SHM_EXCHANGE=0`` (or :func:`set_shm_exchange`) turns it
off, read by :func:`shardkit.distributed.direct_collectives.all_to_all_single`, which the comm ops and the
KJT all-to-all call, and by the DDP comm hook of ``DistributedModelParallel``
(:mod:`shardkit.model_parallel.data_parallel`). It must agree between the ranks (one of
:func:`shardkit.distributed.switches.result_switches`).

Why: gloo moves an all-to-all's bytes through loopback TCP; on the 2-core test machine 4 MiB per peer
took 2.3-3.6 ms where a copy of them takes 0.4 ms, and a 64 B exchange 0.2-0.7 ms of wall.

How (``W`` ranks of a gloo ``group``, all on this host, x86-64): a control block per group
(:mod:`shardkit.distributed.shm_control`) and, per rank, up to :data:`BUFFERS` data files in
``/dev/shm``, each mapped by every rank and unlinked once every rank has mapped it. A call:

- start: the rank picks a data buffer that every peer has finished reading, copies its chunks for
  the others into it, writes the call's entry (buffer, generation, bytes and offset per peer, bytes
  it expects from each) and then its published count; its own chunk goes straight to ``output``;
- ``wait()``: waits for every peer's published count (no gloo in the path), checks every pair's
  sizes (the same check on every rank, so a mismatch is an error on every rank), copies its chunks
  out of the peers' buffers and publishes its done count. Works complete in call order (waiting for
  call n completes the rank's earlier calls first), so any order of ``wait()`` is correct.

A rank reuses a buffer only after every peer's done count passed the call that last used it; when
every buffer is busy it first completes its own pending calls up to that one (it holds their output
tensors), then waits: whatever the program order, no rank waits for a peer that waits for it.

Space: a data file is reserved (``posix_fallocate``) before it is mapped. A rank whose reservation
fails publishes the call with status ``NO_SPACE``; every rank, reading every entry of that call, then
exchanges that call through gloo and every later call through gloo too (the same decision from the
same published data, at the same point of every rank's program).

Every wait ends at the group's timeout with a ``CollectiveTimeoutError`` naming the ranks that did not
publish (or finish reading), the call and the group size; a rank that fails marks itself as left so
that the others stop waiting for it at once. Bytes are copied as they are: all-to-alls are bitwise
gloo's; an all-reduce sums in rank order, the same bits on every rank.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
import uuid
import weakref
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from shardkit.distributed import shm_control, shm_files
from shardkit.distributed.shm_control import DONE, NO_SPACE, OK, PUBLISHED, Control
from shardkit.distributed.shm_files import boot_id, remove_file
from shardkit.distributed.state import register_reset

ENV = "SHARDKIT_SHM_EXCHANGE"
DEFAULT_ENABLED = True  # the setting without SHARDKIT_SHM_EXCHANGE (one line to flip)
BUFFERS = 4  # data buffers per rank and group (two suffice for calls that are waited at once)
SMALL = 128 << 10  # sends up to this many bytes are copied in one piece, the rank's own chunk included
MIN_FILE = 64 << 10
DIRECTORY = "/dev/shm"  # where the files are made (a tmpfs shared by the host's processes; tests move it)
_enabled: Optional[bool] = None


def shm_exchange_enabled() -> bool:
    """Whether CPU all-to-alls of one-host gloo groups go through shared memory."""
    global _enabled
    if _enabled is None:
        value = os.environ.get(ENV)
        if value is None:
            _enabled = DEFAULT_ENABLED
        elif value not in ("0", "1"):
            raise ValueError(f"{ENV}={value!r}: expected 0 or 1")
        else:
            _enabled = value == "1"
    return _enabled


def set_shm_exchange(enabled: bool) -> None:
    """Switch the shared-memory exchange on or off in this process (every rank must do the same)."""
    global _enabled
    _enabled = bool(enabled)


class ShmWork:
    """One call of a :class:`SharedMemoryExchange`: ``wait()`` completes it (and the rank's earlier calls)."""

    __slots__ = ("exchange", "call", "finish", "fallback", "done")

    def __init__(self, exchange, call: int, finish: Callable, fallback: Callable) -> None:
        self.exchange = exchange
        self.call = call
        self.finish = finish  # (entries) -> None: copy the peers' bytes out
        self.fallback = fallback  # () -> None: the same call through gloo
        self.done = False

    def wait(self, timeout=None) -> bool:
        if not self.done:
            self.exchange.complete_through(self.call)
        return True

    def is_completed(self) -> bool:
        return self.done


class _Buffer:
    __slots__ = ("index", "generation", "size", "tensor", "last")

    def __init__(self, index: int) -> None:
        self.index, self.generation, self.size, self.last = index, 0, 0, -1
        self.tensor: Optional[torch.Tensor] = None


class SharedMemoryExchange:
    """This rank's data buffers in ``group``, its mappings of the peers' and the group's control block."""

    def __init__(self, group: dist.ProcessGroup, control: Control, prefix: str, timeout_s: float) -> None:
        # a weak reference: the exchange must not keep the group (and its gloo threads) alive after
        # destroy_process_group (``_EXCHANGES`` is keyed weakly by the group for the same reason)
        self._group = weakref.ref(group)
        self.control, self.prefix = control, prefix
        self.rank, self.world = control.rank, control.world
        self.timeout_s = timeout_s
        self._buffers: List[_Buffer] = []
        self._peers: Dict[tuple, tuple] = {}  # (rank, buffer) -> (generation, tensor)
        self._made: List[tuple] = []  # (call, path): files not unlinked yet
        self._pending: List[ShmWork] = []
        self._calls = 0
        self._completed = 0
        self._gloo_only = False  # set for good once a call found a rank without space
        self._broken: Optional[str] = None
        self._lock = threading.RLock()

    # --- public calls
    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: List[int], input_splits: List[int]
    ):
        """``output`` / ``input``: contiguous uint8; splits: bytes per rank. Returns a work (wait it)."""
        with self._lock:
            self._usable()
            if self._gloo_only:
                return self._gloo_all_to_all(output, input, output_splits, input_splits, async_op=True)
            try:
                return self._start_all_to_all(output, input, output_splits, input_splits)
            except BaseException as err:
                self._fail(err)
                raise

    def exchange_parts(
        self,
        send_bytes: List[int],
        recv_bytes: List[int],
        pack: Callable[[int, torch.Tensor], None],
        unpack: Callable[[int, torch.Tensor], None],
        shared: bool = False,
    ):
        """An all-to-all whose caller writes its chunks into the exchange's buffer and reads the peers'
        out of theirs, so that neither side needs a send or receive buffer of its own.

        ``send_bytes[r]`` / ``recv_bytes[s]``: bytes to rank ``r`` / from rank ``s`` (this rank's own
        entries are checked against each other, but its own chunk is the caller's to move). ``pack(r,
        buf)`` writes the chunk for peer ``r`` into ``buf`` (uint8 ``[send_bytes[r]]``; with ``shared``,
        one chunk that every peer reads: ``pack(-1, buf)`` once, all peers' sizes equal); ``unpack(s,
        view)`` consumes peer ``s``'s chunk, a uint8 view valid during the call only. Chunks start at
        offsets that are sums of earlier chunks' sizes (aligned for one dtype). Returns a work (wait it;
        ``unpack`` runs then, or at once after gloo's exchange where shared memory is out of space)."""
        with self._lock:
            self._usable()
            me, world = self.rank, self.world
            if len(send_bytes) != world or len(recv_bytes) != world:
                raise ValueError(
                    f"shared-memory exchange on rank {me}: {len(send_bytes)} send / {len(recv_bytes)} "
                    f"receive sizes for a group of {world}"
                )
            peers = [r for r in range(world) if r != me and send_bytes[r]]
            if shared and len({send_bytes[r] for r in peers}) > 1:
                raise ValueError(f"shared-memory exchange on rank {me}: one shared chunk, sizes {send_bytes}")
            if self._gloo_only:
                self._gloo_parts(send_bytes, recv_bytes, pack, unpack, shared)
                work = ShmWork(self, -1, None, None)
                work.done = True
                return work
            try:
                starts, pieces, need = [0] * world, [], 0
                for r in peers:
                    if not (shared and pieces):
                        pieces.append((r, need, send_bytes[r]))
                        need += send_bytes[r]
                    starts[r] = pieces[-1][1]
                call = self._calls

                def write(buf: torch.Tensor) -> None:
                    for r, at, n in pieces:
                        pack(-1 if shared else r, buf[at : at + n])

                self._publish(call, need, write, list(send_bytes) + starts + list(recv_bytes))

                def finish(entries: List[List[int]]) -> None:
                    for s in range(world):
                        n = recv_bytes[s]
                        if s != me and n:
                            start = entries[s][4 + world + me]
                            unpack(s, self._peer(s, entries[s])[start : start + n])

                return self._track(
                    call, finish, lambda: self._gloo_parts(send_bytes, recv_bytes, pack, unpack, shared)
                )
            except BaseException as err:
                self._fail(err)
                raise

    def _gloo_parts(self, send_bytes, recv_bytes, pack, unpack, shared: bool) -> None:
        """:meth:`exchange_parts` through gloo, at once: the chunks packed into a send buffer."""
        sends = [0 if r == self.rank else n for r, n in enumerate(send_bytes)]
        recvs = [0 if s == self.rank else n for s, n in enumerate(recv_bytes)]
        send, recv = torch.empty(sum(sends), dtype=torch.uint8), torch.empty(sum(recvs), dtype=torch.uint8)
        for r, chunk in enumerate(send.split(sends)):
            if sends[r]:
                pack(-1 if shared else r, chunk)
        self._gloo_all_to_all(recv, send, recvs, sends, async_op=False)
        for s, chunk in enumerate(recv.split(recvs)):
            if recvs[s]:
                unpack(s, chunk)

    def all_reduce_sum(self, tensor: torch.Tensor, fill: Optional[Callable[[torch.Tensor], None]] = None):
        """Sum contiguous CPU ``tensor`` over the group in place, in rank order (the same bits on every
        rank). Returns a work (wait it).

        ``fill``: this rank's term is not ``tensor``'s contents but what ``fill(out)`` writes into
        ``out`` (a tensor of ``tensor``'s dtype and shape, contents undefined: every element must be
        written), called once: ``out`` is this rank's shared buffer, so the term is made where the
        peers read it (no copy of it); ``tensor`` then only receives the sum."""
        with self._lock:
            self._usable()
            if self._gloo_only:
                if fill is not None:
                    fill(tensor)
                return dist.all_reduce(tensor, group=self.group, async_op=True)
            try:
                return self._start_all_reduce(tensor, fill)
            except BaseException as err:
                self._fail(err)
                raise

    def complete_through(self, call: int) -> None:
        """Complete this rank's pending calls up to ``call``, in call order."""
        with self._lock:
            self._usable()
            try:
                while self._pending and self._pending[0].call <= call:
                    self._complete(self._pending.pop(0))
            except BaseException as err:
                self._fail(err)
                raise

    # --- starting a call
    def _start_all_to_all(self, output, input, output_splits, input_splits) -> ShmWork:
        world, me = self.world, self.rank
        if len(input_splits) != world or len(output_splits) != world:
            raise ValueError(
                f"shared-memory all-to-all on rank {me}: {len(input_splits)} input / {len(output_splits)} "
                f"output splits for a group of {world}"
            )
        at = [0]
        for n in input_splits:
            at.append(at[-1] + n)
        out_at = [0]
        for n in output_splits:
            out_at.append(out_at[-1] + n)
        if at[-1] > input.numel() or out_at[-1] > output.numel():
            raise ValueError(
                f"shared-memory all-to-all on rank {me}: splits {input_splits} / {output_splits} exceed the "
                f"input ({input.numel()} bytes) / output ({output.numel()} bytes)"
            )
        own = input_splits[me]
        if at[-1] <= SMALL:  # one copy, own chunk included
            need, starts = at[-1], at[:world]
            pieces = [(0, 0, need)] if need else []
        else:
            need, starts, pieces = 0, [0] * world, []
            for r in range(world):
                if r != me and input_splits[r]:
                    starts[r] = need
                    pieces.append((need, at[r], input_splits[r]))
                    need += input_splits[r]
        call = self._calls

        def write(buf: torch.Tensor) -> None:
            for dst, src, n in pieces:
                buf[dst : dst + n].copy_(input[src : src + n])

        self._publish(call, need, write, list(input_splits) + starts + list(output_splits))
        if own and output_splits[me] == own:
            output[out_at[me] : out_at[me] + own].copy_(input[at[me] : at[me] + own])

        def finish(entries: List[List[int]]) -> None:
            for s in range(world):
                n = output_splits[s]
                if s != me and n:
                    entry = entries[s]
                    start = entry[4 + world + me]
                    output[out_at[s] : out_at[s] + n].copy_(self._peer(s, entry)[start : start + n])

        def fallback() -> None:
            self._gloo_all_to_all(output, input, output_splits, input_splits, async_op=False)

        return self._track(call, finish, fallback)

    def _start_all_reduce(self, tensor: torch.Tensor, fill: Optional[Callable] = None) -> ShmWork:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(
                f"shared-memory all-reduce: a contiguous CPU tensor, got {tensor.device}, "
                f"contiguous {tensor.is_contiguous()}"
            )
        flat = tensor.view(-1)
        raw = flat.view(torch.uint8)
        nbytes, world, me = raw.numel(), self.world, self.rank
        call = self._calls
        written: List[torch.Tensor] = []  # this rank's term in its buffer, when fill made it there

        def write(buf: torch.Tensor) -> None:
            if fill is None:
                buf[:nbytes].copy_(raw)
            else:
                written.append(buf[:nbytes].view(flat.dtype).view(tensor.shape))
                fill(written[0])

        self._publish(call, nbytes, write, [nbytes] * world + [0] * world + [nbytes] * world)

        def finish(entries: List[List[int]]) -> None:
            if not nbytes:
                return
            parts = [
                flat if s == me else self._peer(s, entries[s])[:nbytes].view(flat.dtype) for s in range(world)
            ]
            if written:
                parts[me] = written[0].view(-1)
            elif me != 0:
                parts[me] = flat.clone()  # the sum below overwrites flat before it reads this rank's term
            torch.add(parts[0], parts[1], out=flat)
            for s in range(2, world):
                flat.add_(parts[s])

        def fallback() -> None:
            if written:
                tensor.copy_(written[0])
            elif fill is not None:  # a rank had no space before this one wrote its term
                fill(tensor)
            dist.all_reduce(tensor, group=self.group)

        return self._track(call, finish, fallback)

    def _track(self, call: int, finish: Callable, fallback: Callable) -> ShmWork:
        work = ShmWork(self, call, finish, fallback)
        self._pending.append(work)
        return work

    def _publish(self, call: int, need: int, write: Callable, header: List[int]) -> None:
        """Take a buffer for ``need`` bytes, ``write`` them into it, publish call ``call``."""
        self._calls = call + 1
        # a rule of program order, the same on every rank (a completion may issue gloo's fallback
        # collective, so it must not depend on timing): call n first completes the rank's calls up to
        # n - BUFFERS. Its own older calls complete, it then waits for no peer that waits for it.
        while self._pending and self._pending[0].call <= call - BUFFERS:
            self._complete(self._pending.pop(0))
        # call n reuses call n - ENTRIES's entry: every peer must have read that call
        self._wait_done(call - shm_control.ENTRIES, "reusing its entry")
        status, buf = OK, None
        if need:
            buf = self._take_buffer(call, need)
            if buf is None:
                status = NO_SPACE
            else:
                write(buf.tensor)
        index, generation, size = (buf.index, buf.generation, buf.size) if buf is not None else (-1, 0, 0)
        self.control.publish(call, status, index, generation, size, header)

    def _take_buffer(self, call: int, need: int) -> Optional[_Buffer]:
        """A buffer every peer has finished reading, holding at least ``need`` bytes (None: no space)."""
        if self._made:
            self._unlink_read()
        reached = self.control.reached
        free = [b for b in self._buffers if b.last < 0 or reached(DONE, b.last + 1)]
        fits = [b for b in free if b.size >= need]
        if fits:
            buf = fits[0]
        elif len(self._buffers) < BUFFERS:
            buf = _Buffer(len(self._buffers))
            self._buffers.append(buf)
        elif free:
            buf = max(free, key=lambda b: b.size)
        else:  # used by calls n - BUFFERS at the latest: complete here (above), maybe not on a peer yet
            buf = min(self._buffers, key=lambda b: b.last)
            self._wait_done(buf.last, "reusing its buffer")
        if buf.size < need and not self._grow(buf, need, call):
            return None
        buf.last = call
        return buf

    def _grow(self, buf: _Buffer, need: int, call: int) -> bool:
        for size in dict.fromkeys((max(need, MIN_FILE, 2 * buf.size), need)):
            path = f"{self.prefix}-{self.rank}-{buf.index}-{buf.generation + 1}"
            try:
                mapping = shm_control.map_file(path, size, create=True)
            except OSError:
                continue
            buf.generation += 1
            buf.size = size
            buf.tensor = torch.frombuffer(mapping, dtype=torch.uint8)
            self._made.append((call, path))  # unlinked once every peer completed ``call`` (mapped it)
            return True
        return False

    # --- completing a call
    def _complete(self, work: ShmWork) -> None:
        call, world = work.call, self.world
        deadline = time.monotonic() + self.timeout_s
        self.control.wait_for(PUBLISHED, call + 1, deadline, "waiting for the peers' bytes", call)
        entries = [self.control.read_entry(r, call) for r in range(world)]
        bad = [
            (s, d, entries[s][4 + d], entries[d][4 + 2 * world + s])
            for s in range(world)
            for d in range(world)
            if entries[s][4 + d] != entries[d][4 + 2 * world + s]
        ]
        if bad:
            raise ValueError(
                f"shared-memory exchange, call {call} of a group of {world}: the ranks disagree on sizes: "
                + "; ".join(f"rank {s} sends {n} bytes to rank {d}, which expects {m}" for s, d, n, m in bad)
            )
        for s in range(world):  # map every new file, read from or not: its maker unlinks it after this
            if s != self.rank and entries[s][1] >= 0 and entries[s][0] == OK:
                self._peer(s, entries[s])
        if any(entry[0] == NO_SPACE for entry in entries):
            self._gloo_only = True  # this call and every later one, on every rank
            work.fallback()
        else:
            work.finish(entries)
        work.done = True
        work.finish = work.fallback = None
        self._completed = call + 1
        self.control.mark_done(call)
        if self._made:
            self._unlink_read()

    def _wait_done(self, call: int, why: str) -> None:
        """Until every peer has completed ``call`` (this rank has: ``_publish``'s rule)."""
        if call < 0 or self.control.reached(DONE, call + 1):
            return
        deadline = time.monotonic() + self.timeout_s
        self.control.wait_for(DONE, call + 1, deadline, f"{why} for call {self._calls - 1}", call)

    def _peer(self, rank: int, entry: List[int]) -> torch.Tensor:
        buffer, generation, size = entry[1], entry[2], entry[3]
        known = self._peers.get((rank, buffer))
        if known is None or known[0] != generation:
            path = f"{self.prefix}-{rank}-{buffer}-{generation}"
            try:
                mapping = shm_control.map_file(path, size, create=False)
            except FileNotFoundError:
                raise RuntimeError(
                    f"shared-memory exchange, rank {self.rank}: rank {rank}'s file {path} is gone (that rank "
                    "closed its exchange or left)"
                ) from None
            known = (generation, torch.frombuffer(mapping, dtype=torch.uint8))
            self._peers[(rank, buffer)] = known
        return known[1]

    def _unlink_read(self, gone=()) -> None:
        """Unlink the files every peer has mapped (every peer but ``gone``: those left)."""
        keep = []
        for call, path in self._made:
            if [r for r in self.control.lagging(DONE, call + 1) if r not in gone]:
                keep.append((call, path))
            else:
                remove_file(path)
        self._made = keep

    # --- gloo, errors, closing
    def _gloo_all_to_all(self, output, input, output_splits, input_splits, async_op: bool):
        return dist.all_to_all_single(
            output, input, output_splits, input_splits, group=self.group, async_op=async_op
        )

    def _usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"shared-memory exchange, rank {self.rank}: unusable after {self._broken}")

    def _fail(self, err: BaseException) -> None:
        """Leave the exchange: the peers stop waiting for this rank; its files go."""
        if self._broken is None:
            self._broken = f"an error at call {self._completed}..{self._calls - 1}: {str(err)[:300]}"
            self.control.mark_left()
            self._drop()

    def _drop(self) -> None:
        for _, path in self._made:
            remove_file(path)
        self._made = []
        self._buffers = []
        self._peers.clear()
        self._pending = []

    @property
    def group(self) -> dist.ProcessGroup:
        group = self._group()
        if group is None:
            raise RuntimeError(f"shared-memory exchange {self.prefix}: its process group was destroyed")
        return group

    def close(self, grace_s: float = 5.0) -> None:
        """Unlink this rank's files (after up to ``grace_s`` for the peers to map the newest) and leave."""
        with self._lock:
            deadline = time.monotonic() + grace_s
            while self._made and self._broken is None and time.monotonic() < deadline:
                self._unlink_read(gone=self.control.left())  # a peer that closed reads no more
                if self._made:
                    time.sleep(1e-3)
            if self._broken is None:
                self._broken = "close()"
                self.control.mark_left(shm_control.CLOSED)
            self._drop()


def _timeout_s(group: dist.ProcessGroup) -> float:
    from shardkit.distributed import timeouts

    timeout = timeouts.process_group_timeout(group) or timeouts.group_timeout()
    return timeout.total_seconds()


def _make(group: dist.ProcessGroup) -> Optional[SharedMemoryExchange]:
    """Set up ``group``'s exchange (a collective of the group, through gloo, once); None where the ranks
    span hosts, the CPU is not strongly ordered or a rank cannot make or map the control block in
    :data:`DIRECTORY` (no room, no such directory, another ``/dev/shm``: every rank then returns None)."""
    rank, world = group.rank(), group.size()
    host = f"{socket.gethostname()}:{boot_id()}"
    prefix, mapping, ok = f"{DIRECTORY}/shardkit-x-{uuid.uuid4().hex[:12]}", None, True
    if rank == 0:
        shm_files.remove_stale_files(DIRECTORY)
        try:
            mapping = shm_control.map_file(prefix + "-control", shm_control.control_bytes(world), create=True)
        except OSError:
            ok = False
    names: List[Optional[tuple]] = [None] * world
    dist.all_gather_object(names, (host, prefix, ok, shm_control.STRONGLY_ORDERED), group=group)
    usable = len({n[0] for n in names}) == 1 and names[0][2] and all(n[3] for n in names)
    prefix = names[0][1]
    if usable and rank != 0:
        try:
            mapping = shm_control.map_file(
                prefix + "-control", shm_control.control_bytes(world), create=False
            )
        except OSError:
            ok = False
    oks: List[Optional[bool]] = [None] * world
    dist.all_gather_object(oks, usable and ok, group=group)  # every rank has mapped it (or failed)
    if rank == 0 and names[0][2]:
        remove_file(prefix + "-control")
    if not all(oks):
        return None
    control = Control(mapping, rank, world, dist.get_process_group_ranks(group))
    return SharedMemoryExchange(group, control, prefix, _timeout_s(group))


_EXCHANGES: weakref.WeakKeyDictionary[dist.ProcessGroup, Optional[SharedMemoryExchange]] = (
    weakref.WeakKeyDictionary()
)


def exchange_for(group: dist.ProcessGroup) -> Optional[SharedMemoryExchange]:
    """The group's exchange (made on its first use: a collective), None where its ranks span hosts,
    its backend is not gloo or the CPU is not strongly ordered (gloo carries the bytes)."""
    try:
        return _EXCHANGES[group]
    except KeyError:
        pass
    exchange = None
    if "gloo" in str(dist.get_backend(group)) and group.size() > 1:
        exchange = _make(group)
        if exchange is not None:  # the group collected: its files unlinked, its peers told
            weakref.finalize(group, exchange.close, 0.0)
    _EXCHANGES[group] = exchange
    return exchange


def close_all() -> None:
    """Unlink this process's files and leave every exchange (tests; process exit)."""
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
atexit.register(close_all)


__all__ = [
    "BUFFERS",
    "DEFAULT_ENABLED",
    "DIRECTORY",
    "ENV",
    "SharedMemoryExchange",
    "ShmWork",
    "close_all",
    "exchange_for",
    "set_shm_exchange",
    "shm_exchange_enabled",
]
