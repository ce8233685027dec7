"""An all-gather of equal flat blocks that takes point-to-point transfers on gloo for large blocks.

``all_gather_into(out, send, group)`` is ``all_gather_single(out, send, group)``: every rank's ``send``
(1-D, the same numel and dtype on every rank) lands in ``out`` (``[world * numel]``), rank ``r``'s at
``out[r * numel : (r + 1) * numel]``. Why not gloo's own all-gather for large blocks: it gathers into
a fresh flat buffer of ``world x numel`` (page faults every call) and then copies every rank's block
out of it, and it moves the data in a ring of small steps; this rank's block sent to every other rank
and theirs received straight into ``out``, all posted before any wait, took 1/4 to 2/3 of its wall
time for 32 MiB blocks (2 gloo ranks on 2 cores, ``docs/performance.md``, "Pooled gradient
all-gather on gloo"). Below ``P2P_MIN_BYTES`` (and on any other backend) it is the backend's
all-gather: for 1-8 MiB blocks the transfers saved little or no wall time, and this rank's copy of
its block into ``out`` is main-thread CPU that gloo spends on a thread of its own. The result is the
same bytes either way (a gather moves data, it adds nothing).

Where the group's CPU byte exchanges go through shared memory (the default on one host:
:mod:`shardkit.distributed.shm_exchange`), the gather does too, whatever the size: this rank's block
copied once into its shared buffer, every peer's copied out of theirs straight into ``out``. The
data-parallel replicas' sparse gathers (a few KiB to MiBs, one per group of tables per backward) took
~300 us each point to point on gloo (2 ranks on 2 cores); through shared memory the all-data-parallel
training steps of plan_quality's table sets ran 1.4-2.4x faster, and with validation on (its
cross-rank checks are small all-gathers) the table-/row-/column-wise ones 1.2-1.8x
(``docs/performance.md``, nineteenth session).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import all_gather_flat
from shardkit.distributed.direct_collectives import shm_exchange_for

# blocks of at least this many bytes go point to point on gloo (the sweep's row-wise gradients of
# 32-256 MiB; 1-8 MiB ones gained no wall time and cost the main thread a copy)
P2P_MIN_BYTES = 16 << 20


class _Transfers:
    """The posted sends and receives of one gather, as one work: ``wait()`` waits for all of them
    (and keeps the tensors they read and write alive until then)."""

    def __init__(self, works: List[dist.Work], tensors: tuple) -> None:
        self._works, self._tensors = works, tensors

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            work.wait()
        self._works, self._tensors = [], ()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def uses_transfers(nbytes: int, group: Optional[dist.ProcessGroup], min_bytes: Optional[int] = None) -> bool:
    """Whether a gather of ``nbytes``-byte blocks over ``group`` goes point to point: on gloo (a
    group of gloo alone or gloo for CPU tensors), from ``min_bytes`` (default ``P2P_MIN_BYTES``) on."""
    if nbytes < (P2P_MIN_BYTES if min_bytes is None else min_bytes):
        return False
    backend = str(dist.get_backend(group))
    return backend == "gloo" or "cpu:gloo" in backend


def _shm_exchange(out: torch.Tensor, world: int, group: Optional[dist.ProcessGroup]):
    """The shared-memory exchange a gather of ``group`` into ``out`` goes through, else None."""
    return None if world == 1 else shm_exchange_for(dist.group.WORLD if group is None else group, out)


def _shm_gather(exchange, out: torch.Tensor, send: torch.Tensor, me: int):
    """Started: this rank's block copied once into its shared buffer, every peer's copied out of
    theirs into ``out`` when the returned work is waited."""
    blocks = out.view(torch.uint8).view(exchange.world, -1)
    sizes = [0 if r == me else blocks.size(1) for r in range(exchange.world)]
    source = send.view(torch.uint8)
    return exchange.exchange_parts(
        sizes,
        sizes,
        lambda _, chunk: chunk.copy_(source),
        lambda s, chunk: blocks[s].copy_(chunk),
        shared=True,
    )


def all_gather_into(
    out: torch.Tensor,
    send: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    async_op: bool = False,
    min_bytes: Optional[int] = None,
):
    """``all_gather_single(out, send, group, async_op)`` (module doc): ``out`` 1-D ``[world * n]``,
    ``send`` 1-D ``[n]``, both contiguous, one dtype; ``send`` may be this rank's block of ``out``
    itself (then nothing is copied into it). Returns the work when ``async_op`` (``wait()`` before
    reading ``out`` or writing ``send``), else None once done. ``min_bytes``: the block size from
    which gloo goes point to point (default ``P2P_MIN_BYTES``; a caller whose block is already in
    ``out``, so that the transfers cost the main thread no copy, may pass 0)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    n = send.numel()
    if out.numel() != world * n:
        raise ValueError(f"all_gather_into: out has {out.numel()} elements, not {world} x {n}")
    mine = out[me * n : (me + 1) * n]
    aliased = send.data_ptr() == mine.data_ptr()
    exchange = _shm_exchange(out, world, group)
    if exchange is not None:
        work = _shm_gather(exchange, out, send, me)
        if not aliased:
            mine.copy_(send)
        if async_op:
            return work
        work.wait()
        return None
    if world == 1 or not uses_transfers(n * send.element_size(), group, min_bytes):
        # the backends read and write the buffers at once: a send inside out goes as a copy
        return all_gather_flat(out, send.clone() if aliased else send, group=group, async_op=async_op)
    works = []
    for peer in range(world):
        if peer != me:
            works.append(dist.isend(send, group=group, group_dst=peer))
            works.append(dist.irecv(out[peer * n : (peer + 1) * n], group=group, group_src=peer))
    if not aliased:
        mine.copy_(send)  # while the transfers run
    transfers = _Transfers(works, (out, send))
    if async_op:
        return transfers
    transfers.wait()
    return None


__all__ = ["P2P_MIN_BYTES", "all_gather_into", "uses_transfers"]
