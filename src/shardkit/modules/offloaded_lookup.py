"""A grouped lookup whose table lives in a slower, larger tier: ``fused_uvm`` and ``fused_uvm_caching``.

The shards' rows and their fused optimizer's state are fields of a :class:`BackingStore` (a mapped file
on CPU), never an in-memory buffer:

- ``uvm``: the kernel reads and updates the mapped file directly; after each step the pages this process
  touched are unmapped again (``madvise``), so its resident memory is what one step touches.
- ``caching``: a :class:`RowCache` of ``load_factor x rows`` rows (weights and optimizer state) in RAM.
  A forward maps its buffer rows to cache slots (loading misses, evicting the least recently / least
  frequently used unpinned rows with write-back), runs the unchanged kernel on the cache with slot ids,
  and keeps those slots pinned until its backward has applied the fused optimizer to them.

The kernels see the same rows and gradients as for an in-memory buffer, only at other positions, and a
row's update does not depend on its position: training is bitwise that of ``fused``.

With ``prefetch`` (``PrefetchTrainPipelineSparseDist``, cache params ``prefetch_pipeline``) a batch's rows
are acquired a step early, on a background thread (:mod:`~shardkit.modules.offload_prefetch`); its
forward takes them over (pinned rows, each id's slot) instead of acquiring again.

``weight`` (and each optimizer state buffer) is the backing field itself, so everything that reads or
writes a table through :meth:`shard_rows` / ``optimizer.state_slices`` (state dicts, checkpoints, loads,
re-initialization) works unchanged: those calls first write the cache back and empty it
(:meth:`sync_storage`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from itertools import accumulate
from typing import List, Optional, Sequence, Tuple

import torch

from shardkit.distributed.validation import host_checks_enabled
from shardkit.kernels import embedding_forward, embedding_fused_backward, embedding_torch
from shardkit.kernels.offload import OffloadSpec
from shardkit.kernels.offload.backing_store import BackingStore, field_specs
from shardkit.kernels.offload.cache_counters import CacheCounters
from shardkit.kernels.offload.narrow_state import narrow_state_fields
from shardkit.kernels.offload.row_cache import RowCache
from shardkit.kernels.offload.row_checks import IdCheck
from shardkit.kernels.offload.write_behind import WriteBehind, write_behind_default
from shardkit.modules.fused_optimizers import FusedOptimizerConfig, SparseRowOptimizer, _state_shapes
from shardkit.modules.grouped_lookup import GroupedEmbeddingLookup, ShardSpec
from shardkit.modules.lookup_kernels import lookup as run_lookup
from shardkit.modules.offload_prefetch import PrefetchedRows, background_prefetch_default

# initialize (and load) an offloaded buffer this many bytes at a time, dropping the pages after each
INIT_CHUNK_BYTES = 16 << 20
# the cache reads misses from / writes victims to the backing file this many rows at a time, unmapping
# the pages after each chunk: a read maps the kernel's fault-around window (64 KiB by default), so one
# chunk maps at most ~IO_CHUNK_ROWS x 64 KiB (16 MiB) whatever the number of misses
IO_CHUNK_ROWS = 256
# with positioned I/O (a backing file: nothing is mapped) the chunk only bounds the staging buffer
IO_BUFFER_BYTES = 16 << 20


class _OffloadedRowOptimizer(SparseRowOptimizer):
    """SparseRowOptimizer whose state tensors are backing fields; reading them syncs the cache first."""

    def __init__(self, config: FusedOptimizerConfig, owner: OffloadedEmbeddingLookup, state: dict) -> None:
        super().__init__(config, 0, 0, device="meta")
        for name, tensor in state.items():
            self.register_buffer(name, tensor, persistent=False)
        self._owner = weakref.ref(owner)

    def reset_state(self) -> None:
        """As :meth:`SparseRowOptimizer.reset_state`, a backing field at a time in chunks of
        ``INIT_CHUNK_BYTES``, the file's pages dropped after each: a fill of the whole field at once made
        all its pages resident (4 bytes x table rows for row-wise Adagrad: 170 MiB at a table 100x a
        16 MiB budget, measured with benchmarks/offload.py's budget run)."""
        owner = self._owner()
        self.step_count = 0
        with torch.no_grad():
            for name, buf in self.named_buffers(recurse=False):
                value = self.config.initial_accumulator_value if name == "sum" else 0.0
                row_bytes = max(1, buf[0].numel() * buf.element_size()) if buf.numel() else 1
                step = max(1, INIT_CHUNK_BYTES // row_bytes)
                for start in range(0, buf.size(0) if buf.dim() else 1, step):
                    (buf[start : start + step] if buf.dim() else buf).fill_(value)
                    if owner is not None:
                        owner.store.drop_resident()

    def state_slices(self, row_start: int, row_end: int):
        owner = self._owner()
        if owner is not None:
            owner.sync_storage()
        return super().state_slices(row_start, row_end)


class _Ticket:
    """A forward's pinned cache slots; released clean if its graph dies without a backward."""

    def __init__(self, cache: RowCache, ticket: int) -> None:
        self.cache, self.ticket = cache, ticket
        self._open = [True]  # shared with the finalizer
        weakref.finalize(self, _release_if_open, cache, ticket, self._open)

    def wait_loaded(self) -> None:
        """The current stream waits until the ticket's rows are in their slots (RowCache.wait_loaded)."""
        self.cache.wait_loaded(self.ticket)

    def release(self, dirty: bool) -> None:
        if self._open[0]:
            self._open[0] = False
            self.cache.release(self.ticket, dirty)


def _release_if_open(cache: RowCache, ticket: int, open_cell: List[bool]) -> None:
    if open_cell[0]:
        open_cell[0] = False
        try:
            # a garbage collection may run this on any thread (and its current stream): a CUDA cache
            # with the device bookkeeping releases on the stream of its acquires (device_slots.py)
            stream = getattr(cache, "_stream", None)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                cache.release(ticket, False)
        except Exception:  # noqa: BLE001 - at interpreter exit the cache may be gone; nothing to write
            pass


class _CachedFusedLookup(torch.autograd.Function):
    """The fused lookup on the cache's tensors; they are looked up at backward time, because a prefetch
    between forward and backward may have grown (reallocated) them, keeping every slot valid."""

    @staticmethod
    def forward(ctx, weight, slot_ids, offsets, weights, bag_scale, pooled, batch_major, owner, ticket):
        ctx.owner, ctx.ticket = owner, ticket
        ctx.pooled, ctx.batch_major = pooled, batch_major
        ctx.save_for_backward(slot_ids, offsets, weights, bag_scale)
        ticket.wait_loaded()
        with owner.cache.buffers_in_use():
            table = owner.cache.tensors["weight"]
            # slot ids come from the cache, in range by construction: no bounds check (a Triton
            # kernel's costs a host sync); the ids themselves were checked by the acquire
            return embedding_forward(
                table, slot_ids, offsets, None, weights, bag_scale, pooled, batch_major, check_ids=False
            )

    @staticmethod
    def backward(ctx, grad_out):
        slot_ids, offsets, weights, bag_scale = ctx.saved_tensors
        owner: OffloadedEmbeddingLookup = ctx.owner
        cache = owner.cache
        args = owner.optimizer.step_args()
        want_psw_grad = weights is not None and ctx.needs_input_grad[3]
        # a prefetch in the background may grow (reallocate) the buffers: not while they are updated
        with cache.buffers_in_use():
            state = tuple(cache.tensors[f"state.{n}"] for n in owner.state_names)
            psw_grad = embedding_fused_backward(
                cache.tensors["weight"],
                slot_ids,
                offsets,
                None,
                weights,
                bag_scale,
                grad_out,
                ctx.pooled,
                dataclasses.replace(args, state=state),
                want_psw_grad,
                ctx.batch_major,
            )
        ctx.ticket.release(dirty=True)  # queued, not waited for, while a prefetch holds the cache
        psw_grad = None if psw_grad is None else psw_grad.to(weights.dtype)
        return None, None, None, psw_grad, None, None, None, None, None


def shard_store(
    shards: Sequence[ShardSpec],
    fields: dict,
    device: torch.device,
    offload: OffloadSpec,
    identity: Optional[dict],
) -> BackingStore:
    """The slow tier of a group of shards: pinned host memory under a CUDA cache (the kernels read device
    memory only, so "uvm" there is a cache of the rows in flight), else a new backing file whose header
    records the shards' tables and ranges plus ``identity``."""
    if device.type == "cuda":
        return BackingStore.in_host_memory(fields)
    header = {"tables": [[s.table_name, s.row_start, s.row_end, s.col_start, s.col_end] for s in shards]}
    header.update(identity or {})
    return BackingStore.create(fields, header, offload.directory, "-".join(s.table_name for s in shards))


def buffer_rows(ids: torch.Tensor, offsets: torch.Tensor, bag_shift: Optional[torch.Tensor]) -> torch.Tensor:
    """int64 ``[N]``: each id's row of the group's buffer (``ids + bag_shift[bag of the id]``)."""
    rows = ids.to(torch.int64)
    if bag_shift is not None:
        rows = rows + torch.repeat_interleave(bag_shift, offsets.diff(), output_size=rows.numel())
    return rows


def shard_id_check(
    lookup: GroupedEmbeddingLookup, ids: torch.Tensor, offsets: torch.Tensor, bags_per_feature
) -> IdCheck:
    """``lookup._check_ids`` as a row cache's :class:`IdCheck` (read in the acquire's host sync): the
    count of ids outside their shard, by queued ops (none for one shard, whose buffer rows are its ids
    shifted: the cache's own range check ``[0, R)`` is that one), and the error naming the first such
    id's feature and table, as the in-memory lookup raises it."""
    bag_bounds = [0, *accumulate(bags_per_feature)]

    def raise_error() -> None:
        lookup._check_ids(ids.to(torch.int64), offsets, bag_bounds)

    if len(lookup.shards) == 1 or not ids.numel():
        return IdCheck(None, raise_error)
    raw = ids.to(torch.int64)
    if lookup._uniform_bounds is not None:
        low, high = lookup._uniform_bounds
        return IdCheck(((raw < low) | (raw >= high)).sum(), raise_error)
    const = lookup._device_constants(raw.device)
    row_lo = lookup._per_id(const.row_lo, offsets, bag_bounds, raw.numel())
    row_hi = lookup._per_id(const.row_hi, offsets, bag_bounds, raw.numel())
    return IdCheck(((raw < row_lo) | (raw >= row_hi)).sum(), raise_error)


def sum_cache_stats(per_table: Sequence[dict]) -> dict:
    """``{table: counters}`` dicts (of several lookups or ranks) summed per table, hit rate recomputed."""
    out: dict = {}
    for stats in per_table:
        for table, counters in stats.items():
            total = out.setdefault(table, {})
            for key, value in counters.items():
                if key != "hit_rate":
                    total[key] = total.get(key, 0) + value
    for total in out.values():
        total["hit_rate"] = total["hits"] / total["lookups"] if total.get("lookups") else 0.0
    return out


class OffloadedEmbeddingLookup(GroupedEmbeddingLookup):
    """A :class:`GroupedEmbeddingLookup` stored in a backing file, optionally behind a row cache.

    Args:
        shards, pooled: as for :class:`GroupedEmbeddingLookup`.
        device: ``cpu`` (the backing tier is a file) or ``cuda`` (the backing tier is pinned host memory and
            the cache is in device memory: ``uvm`` then caches only the rows of the batches in flight).
        fused_optimizer: required: an offloaded table is trained by the fused optimizer in backward.
        offload: the tier and cache (:class:`OffloadSpec`).
        identity: what the backing file's header records (the sharded module passes table and rank).

    ``cache`` is the :class:`RowCache` (None for ``uvm``), ``store`` the :class:`BackingStore`.
    """

    def __init__(
        self,
        shards: Sequence[ShardSpec],
        pooled: bool,
        device: Optional[torch.device] = None,
        fused_optimizer: Optional[FusedOptimizerConfig] = None,
        offload: Optional[OffloadSpec] = None,
        identity: Optional[dict] = None,
    ) -> None:
        names = [s.table_name for s in shards]
        if fused_optimizer is None:
            raise ValueError(
                f"offloaded table(s) {names} need a fused optimizer (fused_params / the module's "
                f"fused_optimizer): the fused_uvm kernels update rows in backward, they give no gradient"
            )
        device = torch.device(device or "cpu")
        if device.type not in ("cpu", "cuda", "meta"):
            raise ValueError(
                f"offloaded table(s) {names}: no offload tier for {device} (CPU: a backing file, CUDA: host "
                f"memory); use the fused kernel on {device.type}"
            )
        super().__init__(shards, pooled, torch.device("meta"), fused_optimizer)
        self.offload = offload or OffloadSpec()
        rows, dim = self.row_offsets[-1], self.embedding_dim
        state_shapes = _state_shapes(fused_optimizer.optimizer, rows, dim)
        self.state_names = list(state_shapes)
        fields = field_specs((rows, dim), self.weight.dtype, state_shapes)
        self.store = shard_store(shards, fields, device, self.offload, identity)
        self.compute_device = torch.device("cpu") if device.type == "meta" else device
        weight = torch.nn.Parameter(self.store.tensors["weight"])
        weight._in_backward_optimizers = [fused_optimizer]
        self.weight = weight
        state = {n: self.store.tensors[f"state.{n}"] for n in self.state_names}
        self.optimizer = _OffloadedRowOptimizer(fused_optimizer, self, state)
        self.cache: Optional[RowCache] = None
        if self.offload.kind == "caching" or self.compute_device.type == "cuda":
            backing = {"weight": self.store.tensors["weight"]}
            backing.update({f"state.{n}": t for n, t in state.items()})
            # a backing file: misses / victims move by preadv / pwritev (no page faults, no pages
            # mapped, nothing to unmap), or, where the file fits $SHARDKIT_OFFLOAD_RESIDENT_MAP,
            # through its mapping kept resident (a memcpy per row, no system call); host memory:
            # through the tensors
            resident = self.compute_device.type == "cpu" and self.store.keep_mapped()
            row_io = None
            if not resident and self.compute_device.type == "cpu":
                # a narrow optimizer state (row-wise Adagrad's one float a row) stays mapped while its
                # bytes are small against the cache's: its rows move by index ops, the file I/O is the
                # weights' alone (narrow_state.narrow_state_fields)
                narrow = narrow_state_fields(fields, self.offload.cache_rows(rows))
                self.store.keep_fields_mapped(narrow)
                row_io = self.store.row_io([n for n in fields if n not in narrow])
            row_bytes = sum(t[0].numel() * t.element_size() for t in backing.values() if t.numel())
            self.cache = RowCache(
                backing,
                self.offload.cache_rows(rows),
                self.offload.algorithm,
                self.compute_device,
                io_chunk_rows=IO_CHUNK_ROWS
                if row_io is None and not resident
                else max(1, IO_BUFFER_BYTES // max(row_bytes, 1)),
                after_io=self.store.drop_resident if row_io is None and not resident else None,
                row_io=row_io,
                # evicted dirty rows written by a background thread (kernels/offload/write_behind.py)
                write_behind=WriteBehind(row_io, keepalive=self.store)
                if row_io is not None and self.compute_device.type == "cpu" and write_behind_default()
                else None,
            )
        elif self.compute_device.type == "cpu":
            self.store.keep_mapped()  # uvm: the kernel reads the mapping; kept if it fits the allowance
        self._prefetched: List[PrefetchedRows] = []
        self._forward_bags: Tuple[int, ...] = ()  # the bag counts of the forward running now
        # prefetches run on the worker thread (a CPU cache only: CUDA copies stay on the caller's stream)
        self.background_prefetch = background_prefetch_default() and self.compute_device.type == "cpu"
        # uvm: what the kernel read from / wrote to the backing file (the caching tier counts its own)
        self._uvm_counters = CacheCounters()
        self._row_bytes = sum(
            t[0].numel() * t.element_size() for t in self.store.tensors.values() if t.numel()
        )
        self.calls = 0
        self.ids_looked_up = 0
        if device.type != "meta":
            self.reset_parameters()

    # ---- direct access to the tables ----------------------------------------------------------

    def sync_storage(self) -> None:
        """Make ``weight`` and the optimizer state authoritative: write the cache back and empty it (only
        flush while a forward's rows await their backward)."""
        if self.cache is None:
            return
        self._settle_prefetches()
        self._drop_prefetches()
        try:
            self.cache.invalidate()
        except RuntimeError:  # a forward awaits its backward: its rows stay cached, values are current
            self.cache.flush()

    def shard_rows(self, index: int, tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
        self.sync_storage()
        return super().shard_rows(index, tensor)

    def reset_parameters(self) -> None:
        """Initialize each shard from its config in chunks of ``INIT_CHUNK_BYTES`` (a shard that fits one
        chunk is initialized whole, as the in-memory lookup does), then zero the optimizer state."""
        self.sync_storage()
        weight = self.weight.data
        row_bytes = max(1, weight.size(1) * weight.element_size())
        chunk_rows = max(1, INIT_CHUNK_BYTES // row_bytes)
        for i, shard in enumerate(self.shards):
            rows = super().shard_rows(i, weight)
            for start in range(0, rows.size(0), chunk_rows):
                shard.config.init_weight_(rows[start : start + chunk_rows])
                self.store.drop_resident()
        self.optimizer.reset_state()
        self.store.drop_resident()

    def cache_stats(self) -> dict:
        """``{table (or "t1+t2" for a group of several): counters}``: lookups (distinct rows per call,
        summed), hits, misses, evictions, rows and bytes read from / written to the backing file, hit
        rate, calls and ids looked up. ``uvm`` has no cache: every row is a miss read from the file (and
        written back by a training step)."""
        self.wait_for_prefetch()  # counted once the background acquire is done
        counters = self._uvm_counters if self.cache is None else self.cache.counters
        stats = counters.as_dict()
        stats.update(calls=self.calls, ids=self.ids_looked_up)
        return {"+".join(s.table_name for s in self.shards): stats}

    def reset_cache_stats(self) -> None:
        """Zero the counters of :meth:`cache_stats`."""
        self.wait_for_prefetch()
        (self._uvm_counters if self.cache is None else self.cache.counters).reset()
        self.calls = self.ids_looked_up = 0

    # ---- the lookup ---------------------------------------------------------------------------

    def prefetch(self, ids: torch.Tensor, offsets: torch.Tensor, bags_per_feature: Sequence[int]) -> None:
        """Load the rows a coming forward will read (``ids`` / ``offsets`` as :meth:`forward` takes them)
        into the cache and pin them until that forward has taken them over. On a CPU cache this runs in
        the background (:attr:`background_prefetch`): the forward of these ids waits for it; an exception
        there is raised by the next forward. No-op for ``uvm``."""
        if self.cache is None:
            return
        offsets = offsets.to(torch.int64)
        bag_shift = self._bag_shift(ids.device, bags_per_feature) if any(self._shifts) else None
        if ids.numel() == 0:
            # nothing to load, but recorded all the same: its forward then finds its own prefetch and
            # leaves the later ones (the coming batches') in flight instead of releasing them
            self._prefetched.append(PrefetchedRows(ids, offsets, bag_shift, lambda: None, False))
            return
        job = functools.partial(self._acquire_rows, ids, offsets, bag_shift, tuple(bags_per_feature))
        self._prefetched.append(PrefetchedRows(ids, offsets, bag_shift, job, self.background_prefetch))

    def wait_for_prefetch(self) -> None:
        """Block until the prefetches in flight are done (their exceptions stay for the next forward)."""
        for record in self._prefetched:
            record.wait()

    def _acquire_rows(self, ids, offsets, bag_shift, bags_per_feature) -> Tuple[_Ticket, torch.Tensor]:
        """Pin the distinct buffer rows of ``ids`` in the cache: (ticket, slot ids [N]), ``ids[k]``'s row
        being in slot ``slot_ids[k]`` (``RowCache.acquire_ids``: the deduplication, lookup and remap in
        native passes where built). Runs in the prefetch thread or the forward's. With validation on
        (``SHARDKIT_VALIDATE``), the ids are checked against their shards in the acquire's host sync
        (:meth:`_id_check`), raising :meth:`_check_ids`'s error before anything is pinned."""
        rows = buffer_rows(ids, offsets, bag_shift)
        id_check = shard_id_check(self, ids, offsets, bags_per_feature) if host_checks_enabled() else None
        # a CUDA cache's copies run on a side stream: the kernel waits for them (_Ticket.wait_loaded)
        handle, slot_ids = self.cache.acquire_ids(rows, wait_copies=False, id_check=id_check)
        return _Ticket(self.cache, handle), slot_ids

    def _checks_ids_itself(self) -> bool:
        return self.cache is not None  # in the acquire's host sync (_acquire_rows)

    def _settle_prefetches(self, count: Optional[int] = None) -> None:
        """Wait for the first ``count`` prefetches in flight (all: None); raise the first one's exception
        (dropping them all), but an ``IndexError`` (an id outside the shard) is left to the forward of
        those ids, which raises it naming the feature (:meth:`_take_prefetched`)."""
        settled = self._prefetched[:count]
        for record in settled:
            record.wait()
        for record in settled:
            if record.error is not None and not isinstance(record.error, IndexError):
                self._drop_prefetches()
                raise record.error

    def _prefetches_for(self, ids, offsets, bag_shift) -> int:
        """How many of the prefetches in flight a forward of these ids settles: those up to the first
        one of exactly these ids (the later ones, asked for the coming batches, e.g. batch i+1's
        during batch i's forward under ``PrefetchTrainPipelineSparseDist``, stay in flight for their
        own forwards), or all of them when none is."""
        for k, record in enumerate(self._prefetched):
            if record.matches(ids, offsets, bag_shift):
                return k + 1
        return len(self._prefetched)

    def _drop_prefetches(self) -> None:
        for record in self._prefetched:
            record.wait()  # one still in flight pins its rows when it ends: release them after that
            if record.outcome is not None:
                record.outcome[0].release(dirty=False)
        self._prefetched.clear()

    def _take_prefetched(self, ids, offsets, bag_shift) -> Optional[tuple]:
        """The prefetch of exactly these ids (the first one), whose pinned rows this forward takes over
        (None: none, or it failed on an id out of range, which this forward's own acquire raises
        again). The prefetches before it are released (all of them when none matches); a failure of
        one of them is raised. The prefetches after it stay in flight."""
        count = self._prefetches_for(ids, offsets, bag_shift)
        records, match = self._prefetched[:count], None
        self._prefetched = self._prefetched[count:]
        for record in records:
            record.wait()  # the forward waited for them already: a no-op unless called without it
            if match is None and record.matches(ids, offsets, bag_shift):
                match = record
            elif record.outcome is not None:
                record.outcome[0].release(dirty=False)
        # raised: any failure but the IndexError of the matching prefetch (this forward raises that)
        failed = [
            r
            for r in records
            if r.error is not None and (r is not match or not isinstance(r.error, IndexError))
        ]
        if failed:
            if match is not None and match.outcome is not None:
                match.outcome[0].release(dirty=False)
            raise failed[0].error
        return None if match is None else match.outcome

    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        bags_per_feature: Sequence[int],
        weights: Optional[torch.Tensor] = None,
        sample_major: bool = False,
    ) -> torch.Tensor:
        """As :meth:`GroupedEmbeddingLookup.forward`, after waiting for the prefetches in flight up to the
        one of these ids (all of them when none is; an exception of one of them is raised here, before
        this forward's own checks). A forward that raises releases the prefetched rows it did not take
        over, waiting for the prefetches still in flight."""
        if self._prefetched:
            # wait for this batch's prefetch (and older ones), not for those of the coming batches
            int_offsets = offsets.to(torch.int64)  # as the kernel gets them (GroupedEmbeddingLookup)
            shifts = None
            if any(self._shifts) and len(bags_per_feature) == len(self.feature_names):
                shifts = self._bag_shift(ids.device, bags_per_feature)  # else: the forward's ValueError
            self._settle_prefetches(self._prefetches_for(ids, int_offsets, shifts))
        self._forward_bags = tuple(bags_per_feature)  # for the id check of this forward's acquire
        try:
            return super().forward(ids, offsets, bags_per_feature, weights, sample_major)
        except BaseException:
            self._drop_prefetches()
            raise

    def _count_uvm(self, ids, offsets, bag_shift) -> None:
        rows = int(torch.unique(buffer_rows(ids, offsets, bag_shift)).numel())
        c = self._uvm_counters
        c.lookups += rows
        c.misses += rows
        c.rows_read += rows
        c.bytes_read += rows * self._row_bytes
        if torch.is_grad_enabled() and self.weight.requires_grad:  # the fused backward writes them back
            c.rows_written += rows
            c.bytes_written += rows * self._row_bytes

    def _run_kernel(self, ids, offsets, bag_shift, weights, bag_scale, batch_major):
        self.store.drop_resident()  # the pages the previous step touched
        self.calls += 1
        self.ids_looked_up += ids.numel()
        if self.cache is None:
            self._count_uvm(ids, offsets, bag_shift)
            return run_lookup(
                self.weight,
                ids,
                offsets,
                bag_shift,
                weights,
                bag_scale,
                self.pooled,
                self.optimizer,
                batch_major,
            )
        taken = self._take_prefetched(ids, offsets, bag_shift) if self._prefetched else None
        if taken is None:
            taken = self._acquire_rows(ids, offsets, bag_shift, self._forward_bags)
        ticket, slot_ids = taken
        train = torch.is_grad_enabled() and self.weight.requires_grad
        if train:
            return _CachedFusedLookup.apply(
                self.weight, slot_ids, offsets, weights, bag_scale, self.pooled, batch_major, self, ticket
            )
        ticket.wait_loaded()
        with self.cache.buffers_in_use():
            table = self.cache.tensors["weight"]
            if torch.is_grad_enabled() and weights is not None and weights.requires_grad:
                # frozen table, trained per-sample weights: the differentiable path over the cached rows
                out = embedding_torch.embedding_forward(
                    table, slot_ids, offsets, None, weights, bag_scale, self.pooled, batch_major
                )
            else:
                out = embedding_forward(
                    table,
                    slot_ids,
                    offsets,
                    None,
                    weights,
                    bag_scale,
                    self.pooled,
                    batch_major,
                    check_ids=False,  # slot ids: in range by construction
                )
        ticket.release(dirty=False)
        return out


__all__ = [
    "INIT_CHUNK_BYTES",
    "OffloadedEmbeddingLookup",
    "buffer_rows",
    "shard_id_check",
    "shard_store",
    "sum_cache_stats",
]
