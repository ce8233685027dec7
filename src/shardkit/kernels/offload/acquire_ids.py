"""The lookups' entry to a :class:`~shardkit.kernels.offload.row_cache.RowCache` (L0): ``acquire_ids``,
the step's ids (repeats, any order) deduplicated, acquired and each remapped to its slot.

A mixin of ``RowCache``; three ways to the same pins, stamps, victims and counters: the device
bookkeeping (``device_slots.py``, one host sync), the native ops on the host (``csrc/row_cache_ids.cpp``:
two passes, no sort of the ids) and ``torch.unique`` + ``acquire`` + a gather (the pure-torch path and
every case the native pass does not take).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from shardkit.kernels.embedding import RowOutOfRange
from shardkit.kernels.offload.row_checks import IdCheck


class AcquireIds:
    """``RowCache.acquire_ids`` and its host paths (see the module docstring)."""

    def acquire_ids(
        self, ids: torch.Tensor, wait_copies: bool = True, id_check: Optional[IdCheck] = None
    ) -> Tuple[int, torch.Tensor]:
        """:meth:`acquire` of the distinct rows of ``ids``, with each id remapped to its slot.

        The same as ``unique, inverse = torch.unique(ids, return_inverse=True)``, ``ticket, slots =
        acquire(unique)``, ``slots[inverse]`` (the same rows acquired in the same order, so the same pins,
        stamps, victims and counters), which is what runs on the pure-torch path. With the native ops and
        ids and buffers on the host, the deduplication, the lookup and the remap are two native passes
        instead (``csrc/row_cache_ids.cpp``: no sort of the ids, no separate lookup or gather).

        Args:
            ids: row numbers in ``[0, R)``, an integer tensor ``[N]`` (repeats allowed, any order, any
                device); ``N = 0`` is fine.
            wait_copies: as for :meth:`acquire` (a CUDA cache's side-stream copies).
            id_check: the caller's own check of ``ids`` (:class:`~shardkit.kernels.offload.row_checks.
                IdCheck`: a count of the ids it rejects, and the function raising its error), applied
                before anything is pinned; the device bookkeeping reads the count in its one host sync.
        Returns:
            ``(ticket, slot_ids)``: the ticket for :meth:`release` and int64 ``[N]`` on :attr:`device`,
            ``slot_ids[k]`` the slot of row ``ids[k]``.
        Raises:
            as :meth:`acquire` (RowOutOfRange for an id outside ``[0, R)``, naming its position in the
            distinct rows).
        """
        if self.bookkeeping == "device":
            if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex:
                return self.acquire(ids)  # raises its TypeError naming what is wrong
            if ids.dim() == 1 and ids.dtype != torch.bool and ids.numel() and self.num_rows:
                with self._locked("acquire_ids"):
                    ticket, slot_ids = self._acquire_on_device(ids.to(self._book_device), None, id_check)
                if wait_copies:
                    self.wait_loaded(ticket)
                return ticket, slot_ids
            # else acquire's errors; no ids: nothing to sync for
        if id_check is None:
            return self._acquire_ids_host(ids, wait_copies)
        if id_check.bad is not None and int(id_check.bad):
            id_check.raise_error()
        try:
            return self._acquire_ids_host(ids, wait_copies)
        except RowOutOfRange:
            id_check.raise_error()  # the caller's error where it names the id
            raise

    def _acquire_ids_host(self, ids: torch.Tensor, wait_copies: bool) -> Tuple[int, torch.Tensor]:
        """:meth:`acquire_ids` with the host bookkeeping (and the device path's degenerate cases)."""
        if self.bookkeeping == "device":
            return self.acquire(ids, wait_copies)
        native = self._native()
        if (
            native is None
            or not hasattr(native, "row_cache_lookup_ids")
            or self.device.type != "cpu"
            or not isinstance(ids, torch.Tensor)
            or ids.device.type != "cpu"
            or ids.dim() != 1
            or ids.dtype not in (torch.int64, torch.int32)
            or ids.numel() == 0
            or self.num_rows > 2**32
        ):
            return self._acquire_ids_unique(ids, wait_copies)
        ids = ids.to(torch.int64).contiguous()
        low, high = torch.aminmax(ids)
        if int(low) < 0 or int(high) >= self.num_rows:  # raised by acquire as for any other path
            return self._acquire_ids_unique(ids, wait_copies)
        with self._locked():
            self._sync_queue(native)
            book = self._slot_map.tensors
            rows, looked, miss_rows, inverse = native.row_cache_lookup_ids(
                book, self.num_rows, self._pins, ids
            )
            return self._acquire_looked(rows, looked, miss_rows, True, native, inverse)

    def _acquire_ids_unique(self, ids: torch.Tensor, wait_copies: bool = True) -> Tuple[int, torch.Tensor]:
        """:meth:`acquire_ids` by ``torch.unique``, :meth:`acquire` and a gather of the slots."""
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex:
            return self.acquire(ids)  # raises its TypeError naming what is wrong
        rows = ids
        if ids.numel():
            if self.num_rows < 2**31 and ids.dtype not in (torch.int32, torch.bool):
                low, high = torch.aminmax(ids)
                if int(low) >= 0 and int(high) < self.num_rows:
                    # int32 rows: torch.unique (a sort) takes half the time; only when every row fits, so
                    # that an id out of range is never wrapped into a valid row (acquire refuses it)
                    rows = ids.to(torch.int32)
        unique, inverse = torch.unique(rows, return_inverse=True)
        ticket, slots = self.acquire(unique, wait_copies)
        return ticket, slots.index_select(0, inverse.flatten().to(slots.device)).view(inverse.shape)


__all__ = ["AcquireIds"]
