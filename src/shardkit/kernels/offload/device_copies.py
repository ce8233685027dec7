"""A CUDA row cache's copies to and from its host backing, on a side stream (L0).

Under a CUDA :class:`~shardkit.kernels.offload.row_cache.RowCache` the backing store is pinned host
memory and the cache is in device memory. Copying the misses in on the caller's (compute) stream would
queue them behind, and the kernels after them behind the copies; as fbgemm's UVM cache does, the copies
here run on a stream of their own, so that a prefetch of batch i+1 moves its rows while batch i's
kernels run:

- **reads** (misses): the rows are gathered on the host into a pinned staging buffer, copied to the
  device and scattered into their slots on the copy stream. The copy stream first waits for the compute
  stream (a slot being refilled may still be read by a kernel queued there before its row was evicted).
  Every acquire records an event on the copy stream (:meth:`DeviceCopies.mark`): a kernel that uses the
  acquire's slots makes its own stream wait for that event first (``RowCache.wait_loaded``), so it reads
  the rows loaded for it, and rows an earlier acquire loaded (a hit on a row whose copy is in flight).
- **write-backs** (dirty victims): gathered from their slots on the copy stream (after the compute
  stream's queued updates of them), copied into a pinned staging buffer, and written into the backing
  tensors on the host once that copy is done: at the next acquire that reads misses (before the host
  gathers them: a row evicted and asked again reads its written value) or at a flush. Until then the
  staging buffers are held: the dirty victims of one acquire.
- The host waits for the device only there: the previous acquire's write-back copies (queued one
  acquire earlier, normally done) and a flush (``RowCache.flush`` / ``invalidate``: state dicts,
  checkpoints).

``SHARDKIT_OFFLOAD_COPY_STREAM=0`` turns this off (the copies then run on the caller's stream, as
before); it applies to caches created after it is set.
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

import torch


def copy_stream_default() -> bool:
    """Whether new CUDA caches copy on a side stream (``SHARDKIT_OFFLOAD_COPY_STREAM``, default on)."""
    value = os.environ.get("SHARDKIT_OFFLOAD_COPY_STREAM", "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on", "no", "yes"):
        raise ValueError(f"SHARDKIT_OFFLOAD_COPY_STREAM={value!r}: expected 0 or 1")
    return value in ("1", "true", "on", "yes")


class DeviceCopies:
    """Rows moved between host ``backing`` tensors (pinned) and device ``tensors`` on a side stream.

    Args:
        device: the cache's CUDA device.
        backing: field name -> pinned host tensor ``[R, *width]``, the cache's backing store.
    """

    def __init__(self, device: torch.device, backing: Dict[str, torch.Tensor]) -> None:
        self.device = device
        self.backing = backing
        self.stream = torch.cuda.Stream(device)
        # write-backs whose device-to-host copy may still run: (event, rows int64 [n] host, staged
        # field -> pinned [n, *width]), in eviction order; all land before the next read
        self._pending: List[Tuple[torch.cuda.Event, torch.Tensor, Dict[str, torch.Tensor]]] = []

    def _after_compute(self) -> None:
        """The copy stream waits for the work queued so far on the caller's stream."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def read(self, tensors: Dict[str, torch.Tensor], rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy backing rows ``rows`` (int64 [n], host) into slots ``slots`` (int64 [n]) of ``tensors``."""
        self.land()  # a row evicted and asked again: its write lands before it is gathered
        self._after_compute()
        staged = {}
        for name, store in self.backing.items():
            buffer = torch.empty((rows.numel(), *store.shape[1:]), dtype=store.dtype, pin_memory=True)
            staged[name] = torch.index_select(store, 0, rows, out=buffer)
        with torch.cuda.stream(self.stream):
            # allocated on the copy stream: freed in its order, never reused while a copy runs
            device_slots = slots.to(self.device, non_blocking=True)
            for name, values in staged.items():
                # the host allocator keeps a pinned block until the copies that read it are done
                tensors[name].index_copy_(0, device_slots, values.to(self.device, non_blocking=True))

    def write(self, tensors: Dict[str, torch.Tensor], rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy slots ``slots`` of ``tensors`` to backing rows ``rows`` (int64 [n], host): gathered now on
        the copy stream, written into ``backing`` by a later :meth:`land`."""
        self._after_compute()
        staged = {}
        with torch.cuda.stream(self.stream):
            device_slots = slots.to(self.device, non_blocking=True)
            for name, buffer in tensors.items():
                values = buffer.index_select(0, device_slots)
                host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                staged[name] = host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.stream)
        self._pending.append((event, rows, staged))

    def land(self) -> None:
        """Write the pending write-backs into the backing tensors, waiting for their copies (queued by an
        earlier acquire: normally done by the next one). Every pending write lands, not just those of
        the rows about to be read: finding those (``isin`` of the misses in the written rows) cost more
        on the host (2.5 ms a step at 27k misses on the H200 machine) than the writes themselves."""
        for event, written, staged in self._pending:
            event.synchronize()
            for name, values in staged.items():
                self.backing[name].index_copy_(0, written, values)
        self._pending = []

    def mark(self) -> torch.cuda.Event:
        """An event after every copy queued so far (a kernel's stream waits for it before using slots)."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def fence(self) -> None:
        """The caller's stream waits for every copy queued so far (before buffers are reallocated or
        read outside a kernel)."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    @property
    def pending_writes(self) -> int:
        """Write-backs not yet landed in the backing store."""
        return len(self._pending)


__all__ = ["DeviceCopies", "copy_stream_default"]
