"""Prefetching an offloaded table's rows for a coming forward, in a background thread (L1).

``PrefetchTrainPipelineSparseDist`` hands each offloaded lookup batch i+1's ids during step i
(:meth:`~shardkit.modules.offloaded_lookup.OffloadedEmbeddingLookup.prefetch`). The work (the buffer rows
of the ids, :meth:`RowCache.acquire_ids`: deduplication, slot assignment, eviction with write-back of
dirty victims, reading the misses) then runs on one process-wide worker thread while the main thread
runs step i's backward; the forward of batch i+1 waits for it (:meth:`PrefetchedRows.wait`) and takes
over its pinned rows and each id's slot, so it neither acquires nor deduplicates again.
``os.preadv`` / ``os.pwritev`` and torch's CPU ops release the GIL, so on a second core the miss I/O
overlaps the step's compute.

Why this is safe (see also :mod:`~shardkit.kernels.offload.row_cache`, "Threads"):

- the cache's bookkeeping is touched by one thread at a time (its lock); a release by the main thread
  (step i's backward) while the worker holds it is queued, so batch i's rows stay pinned (never a
  victim) until it is applied, and their dirty flags are set before they can be evicted;
- the worker writes only free or evicted (unpinned) slots; the main thread's kernels write only the
  slots of their own pinned tickets; a growth of the buffers waits for a kernel using them in place;
- one worker thread: prefetches run in the order they were asked for, one at a time.

An exception in the worker is kept with its batch and raised (the same exception object: its type,
message and traceback) by the next forward of that lookup, or by :meth:`sync_storage`; it is never lost.

``SHARDKIT_OFFLOAD_PREFETCH_THREAD=0`` (or a lookup's ``background_prefetch = False``) runs the same
prefetch synchronously, inside the pipeline's call; a cache on a CUDA device always does.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any, Callable, Optional

import torch

ENV_VAR = "SHARDKIT_OFFLOAD_PREFETCH_THREAD"

_executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
_executor_pid: Optional[int] = None
_executor_lock = threading.Lock()


def background_prefetch_default() -> bool:
    """Whether prefetches run in the background thread unless a lookup says otherwise (the environment
    variable ``SHARDKIT_OFFLOAD_PREFETCH_THREAD``: ``0`` / ``false`` / ``no`` / ``off`` turn it off)."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def prefetch_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process's prefetch worker: one thread (a new one after a fork, whose child has no threads)."""
    global _executor, _executor_pid
    with _executor_lock:
        if _executor is None or _executor_pid != os.getpid():
            name = "shardkit-offload-prefetch"
            _executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
            _executor_pid = os.getpid()
        return _executor


def _version(tensor: Optional[torch.Tensor]) -> Optional[int]:
    """The version counter of ``tensor``'s storage (bumped by every in-place write to it or a view),
    or None (no tensor, or an inference tensor, which has none)."""
    if tensor is None:
        return None
    try:
        return tensor._version
    except RuntimeError:
        return None


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same elements of the same memory."""
    # the prefetch holds ``a``: no other storage can sit at its address while it lives
    return a.device == b.device and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()


class PrefetchedRows:
    """One batch's prefetch: what it was asked for and what it became.

    Args:
        ids: the batch's ids ``[N]`` (any integer dtype), offsets int64 ``[bags + 1]``, bag_shift int64
            ``[bags]`` or None: as the forward will pass them to the kernel.
        job: computes the outcome (called now, or in the worker when ``background``).

    ``outcome`` (after :meth:`wait`) is what ``job`` returned, ``error`` the exception it raised.
    """

    def __init__(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        bag_shift: Optional[torch.Tensor],
        job: Callable[[], Any],
        background: bool,
    ) -> None:
        self.ids, self.offsets, self.bag_shift = ids, offsets, bag_shift
        self._versions = tuple(_version(t) for t in (ids, offsets, bag_shift))
        self.outcome: Any = None
        self.error: Optional[BaseException] = None
        self._future: Optional[concurrent.futures.Future] = None
        if background:
            self._future = prefetch_executor().submit(job)
        else:
            try:
                self.outcome = job()
            except Exception as error:  # noqa: BLE001 - kept, raised by the forward as in the background
                self.error = error

    def wait(self) -> None:
        """Block until the job is done; its result goes to ``outcome``, its exception to ``error``."""
        if self._future is None:
            return
        future, self._future = self._future, None
        try:
            self.outcome = future.result()
        except Exception as error:  # noqa: BLE001 - raised by the caller, with its own traceback
            self.error = error

    def matches(self, ids: torch.Tensor, offsets: torch.Tensor, bag_shift: Optional[torch.Tensor]) -> bool:
        """Whether a forward of ``ids`` / ``offsets`` / ``bag_shift`` reads exactly the prefetched rows
        (compared by value: the forward may get other tensor objects for the same batch). Not once
        the prefetched tensors were written in place (their version counter moved: the rows were
        acquired for other values). A view of the same memory (address, shape, strides, dtype) is
        matched without reading the values, which on a GPU would be a host sync (a sharded module
        splits its input per group into new views a call). Two empty batches of ids match (no rows)."""

        def same(a: Optional[torch.Tensor], b: Optional[torch.Tensor], version: Optional[int]) -> bool:
            if a is None or b is None:
                return a is None and b is None
            if version is not None and _version(a) != version:
                return False  # written since the prefetch: its rows were acquired for other values
            if a is b:
                return True
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            if version is not None and _same_view(a, b):
                return True  # the same memory, unchanged since the prefetch
            return torch.equal(a, b)

        if self.ids.numel() == 0 and ids.numel() == 0:
            return True  # neither reads a row (compared without reading values: a sync on a GPU)
        mine = (self.ids, self.offsets, self.bag_shift)
        return all(same(a, b, v) for a, b, v in zip(mine, (ids, offsets, bag_shift), self._versions))


__all__ = ["ENV_VAR", "PrefetchedRows", "background_prefetch_default", "prefetch_executor"]
