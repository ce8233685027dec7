"""Quantized inference tables in a slower, larger tier: ``quant_uvm`` and ``quant_uvm_caching``.

The quantized rows (``[rows, row bytes]`` uint8: codes, then each row's scale and bias) are the field
``weight`` of a :class:`BackingStore` (a mapped file on CPU, pinned host memory under a CUDA cache):

- ``uvm``: the quantized kernel reads the mapped rows directly (pages touched by one batch are unmapped
  again before the next);
- ``caching``: a read-only :class:`RowCache` of ``load_factor x rows`` rows; a batch's rows are loaded
  (least recently / least frequently used ones evicted, nothing to write back: inference never writes)
  and the unchanged kernel runs on the cache with slot ids, so the answers equal the in-memory ``quant``
  kernel's bitwise.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from shardkit.distributed.validation import host_checks_enabled
from shardkit.kernels.offload import OffloadSpec
from shardkit.kernels.offload.cache_counters import CacheCounters
from shardkit.kernels.offload.row_cache import RowCache
from shardkit.kernels.quant_embedding import quant_embedding_forward
from shardkit.kernels.quant_rows import row_bytes
from shardkit.modules.fused_optimizers import FusedOptimizerConfig
from shardkit.modules.grouped_lookup import ShardSpec
from shardkit.modules.offloaded_lookup import buffer_rows, shard_id_check, shard_store
from shardkit.quant.quant_lookup import QuantGroupedEmbeddingLookup


class OffloadedQuantEmbeddingLookup(QuantGroupedEmbeddingLookup):
    """A :class:`QuantGroupedEmbeddingLookup` whose byte rows live in a backing store.

    Args: as :class:`QuantGroupedEmbeddingLookup`, plus ``offload`` (the tier and cache) and ``identity``
    (recorded in the backing file's header). ``cache`` is None for ``uvm`` on CPU.
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
        device = torch.device(device or "cpu")
        names = [s.table_name for s in shards]
        if device.type not in ("cpu", "cuda", "meta"):
            raise ValueError(f"offloaded quantized table(s) {names}: no offload tier for {device}")
        super().__init__(shards, pooled, torch.device("meta"), fused_optimizer)
        self.offload = offload or OffloadSpec()
        rows = self.row_offsets[-1]
        fields = {"weight": ((rows, row_bytes(self.embedding_dim, self.storage)), torch.uint8)}
        self.store = shard_store(shards, fields, device, self.offload, identity)
        del self.weight
        self.register_buffer("weight", self.store.tensors["weight"])
        self.compute_device = torch.device("cpu") if device.type == "meta" else device
        self.cache: Optional[RowCache] = None
        if self.offload.kind == "caching" or self.compute_device.type == "cuda":
            capacity = self.offload.cache_rows(rows)
            self.cache = RowCache(
                {"weight": self.weight}, capacity, self.offload.algorithm, self.compute_device
            )
        self._uvm_counters = CacheCounters()
        self._forward_bags: Tuple[int, ...] = ()  # the bag counts of the forward running now
        if device.type != "meta":
            self.reset_parameters()

    def sync_storage(self) -> None:
        """Drop the cache (its rows are never dirty) so that direct writes to ``weight`` are seen."""
        if self.cache is not None:
            self.cache.invalidate()

    def shard_rows(self, index: int, tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
        self.sync_storage()
        return super().shard_rows(index, tensor)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.store.drop_resident()

    def cache_stats(self) -> dict:
        """As ``OffloadedEmbeddingLookup.cache_stats`` (nothing is ever written back)."""
        counters = self._uvm_counters if self.cache is None else self.cache.counters
        return {"+".join(s.table_name for s in self.shards): counters.as_dict()}

    def forward(self, ids, offsets, bags_per_feature, weights=None, sample_major=False) -> torch.Tensor:
        self._forward_bags = tuple(bags_per_feature)  # for the id check of this forward's acquire
        return super().forward(ids, offsets, bags_per_feature, weights, sample_major)

    def _checks_ids_itself(self) -> bool:
        return self.cache is not None  # in the acquire's host sync (_run_kernel)

    def _run_kernel(self, ids, offsets, bag_shift, weights, bag_scale, batch_major) -> torch.Tensor:
        self.store.drop_resident()
        rows = buffer_rows(ids, offsets, bag_shift)
        if self.cache is None:
            count = torch.unique(rows).numel()
            c = self._uvm_counters
            c.lookups += count
            c.misses += count
            c.rows_read += count
            c.bytes_read += count * self.weight.size(1)
            return super()._run_kernel(ids, offsets, bag_shift, weights, bag_scale, batch_major)
        # the distinct rows acquired (on the device with the device bookkeeping: one host sync, which
        # also checks the ids against their shards with validation on), each id remapped to its slot
        id_check = shard_id_check(self, ids, offsets, self._forward_bags) if host_checks_enabled() else None
        ticket, slot_ids = self.cache.acquire_ids(rows, id_check=id_check)
        try:
            return quant_embedding_forward(
                self.cache.tensors["weight"],
                self.storage,
                self.embedding_dim,
                slot_ids,
                offsets,
                None,
                weights,
                bag_scale,
                self.pooled,
                batch_major,
                check_ids=False,  # slot ids: in range by construction
            )
        finally:
            self.cache.release(ticket, dirty=False)


__all__ = ["OffloadedQuantEmbeddingLookup"]
