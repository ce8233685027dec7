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

**Zero-copy (UVA).** Pinned host memory is addressable by the GPU (unified virtual addressing), so
where the backing can be viewed as a CUDA tensor (:func:`device_view`), both directions are GPU
gathers and scatters on the copy stream that read and write host memory over the bus: no gather on
the host, no staging buffer, nothing to land (a later read of an evicted row is ordered after its
write on the same stream); only a flush waits for the copy stream. This is how fbgemm's UVM tables
reach host memory. Where the view cannot be made (memory not pinned, a driver without UVA), the staged
copies above are used. ``SHARDKIT_OFFLOAD_UVA=0`` forces the staged copies.

``SHARDKIT_OFFLOAD_COPY_STREAM=0`` turns the side stream off (the copies then run on the caller's
stream, as before). Both variables apply to caches created after they are set.
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

import torch


def _switch(name: str) -> bool:
    value = os.environ.get(name, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on", "no", "yes"):
        raise ValueError(f"{name}={value!r}: expected 0 or 1")
    return value in ("1", "true", "on", "yes")


def copy_stream_default() -> bool:
    """Whether new CUDA caches copy on a side stream (``SHARDKIT_OFFLOAD_COPY_STREAM``, default on)."""
    return _switch("SHARDKIT_OFFLOAD_COPY_STREAM")


class _CudaArray:
    """An object exposing ``__cuda_array_interface__`` (how ``torch.as_tensor`` wraps foreign memory)."""

    def __init__(self, interface: dict) -> None:
        self.__cuda_array_interface__ = interface


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over the memory of the pinned host tensor ``host`` (same shape and dtype, no copy):
    kernels on it read and write the host memory over the bus (unified virtual addressing).

    Raises ValueError when ``host`` is not a contiguous pinned CPU tensor, and what torch raises where
    the driver does not map that memory for ``device``.
    """
    if host.device.type != "cpu" or not host.is_pinned() or not host.is_contiguous():
        raise ValueError("device_view: needs a contiguous pinned CPU tensor")
    raw = host.view(torch.uint8).reshape(-1) if host.numel() else host.new_empty(0, dtype=torch.uint8)
    interface = {"shape": (raw.numel(),), "typestr": "|u1", "data": (raw.data_ptr(), False), "version": 2}
    with torch.cuda.device(device):
        view = torch.as_tensor(_CudaArray(interface), device=device)
    return view.view(host.dtype).view(host.shape)


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
        # the backing's fields as CUDA tensors over the same host memory (zero-copy), or None: staged
        self.views = self._device_views() if _switch("SHARDKIT_OFFLOAD_UVA") else None
        # write-backs whose device-to-host copy may still run: (event, rows int64 [n] host, staged
        # field -> pinned [n, *width]), in eviction order; all land before the next read
        self._pending: List[Tuple[torch.cuda.Event, torch.Tensor, Dict[str, torch.Tensor]]] = []
        self._unsynced = False  # zero-copy writes queued since the last land

    def _device_views(self):
        try:
            views = {name: device_view(store, self.device) for name, store in self.backing.items()}
        except (ValueError, RuntimeError, TypeError):  # not pinned, or not mapped: the staged copies
            return None
        return views

    def _after_compute(self, *indices: torch.Tensor) -> None:
        """The copy stream waits for the work queued so far on the caller's stream; ``indices`` made on
        that stream (the device bookkeeping's rows and slots) stay allocated until the copy stream has
        used them."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for index in indices:
            if index.is_cuda:
                index.record_stream(self.stream)

    def read(self, tensors: Dict[str, torch.Tensor], rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy backing rows ``rows`` (int64 [n], host) into slots ``slots`` (int64 [n]) of ``tensors``."""
        if self.views is not None:  # zero-copy: a gather from host memory by the GPU
            self._after_compute(rows, slots)
            with torch.cuda.stream(self.stream):
                device_rows = rows.to(self.device, non_blocking=True)
                device_slots = slots.to(self.device, non_blocking=True)
                for name, view in self.views.items():
                    tensors[name].index_copy_(0, device_slots, view.index_select(0, device_rows))
            return
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
        the copy stream, written into ``backing`` by a later :meth:`land` (zero-copy: scattered into the
        host memory by the GPU, on the copy stream; ``rows`` / ``slots`` may then be on the device)."""
        self._after_compute(rows, slots)
        if self.views is not None:
            with torch.cuda.stream(self.stream):
                device_rows = rows.to(self.device, non_blocking=True)
                device_slots = slots.to(self.device, non_blocking=True)
                for name, buffer in tensors.items():
                    self.views[name].index_copy_(0, device_rows, buffer.index_select(0, device_slots))
            self._unsynced = True
            return
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
        if self._unsynced:  # zero-copy writes: done once the copy stream is
            self.stream.synchronize()
            self._unsynced = False
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
        """Write-backs not yet landed in the backing store (zero-copy: 1 while any may be in flight)."""
        return len(self._pending) + int(self._unsynced)


__all__ = ["DeviceCopies", "copy_stream_default", "device_view"]
