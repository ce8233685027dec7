"""The table-batched lookup of quantized tables: shards of one width and storage in one byte buffer.

:class:`QuantGroupedEmbeddingLookup` is a :class:`~shardkit.modules.GroupedEmbeddingLookup` (same
shards, feature order, id validation, shifts, MEAN scales) whose buffer ``weight`` is a ``uint8``
``[sum of shard rows, row_bytes(width, storage)]`` buffer of stored rows
(:mod:`shardkit.kernels.quant_rows`) instead of a float parameter, and whose kernel dequantizes the
rows it reads inside the lookup (:func:`shardkit.kernels.quant_embedding.quant_embedding_forward`).
It outputs fp32 and has no gradient: it serves, it does not train.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from shardkit.kernels.quant_embedding import quant_embedding_forward
from shardkit.kernels.quant_rows import quantize_rows, row_bytes
from shardkit.modules.fused_optimizers import FusedOptimizerConfig
from shardkit.modules.grouped_lookup import GroupedEmbeddingLookup, ShardSpec
from shardkit.quant.data_types import storage_of

_CHUNK_ROWS = 1 << 16  # rows quantized at a time: bounds the fp32 temporaries of a conversion


@torch.no_grad()
def quantize_into(
    dst: torch.Tensor,
    src: torch.Tensor,
    storage: str,
    row_min: Optional[torch.Tensor] = None,
    row_max: Optional[torch.Tensor] = None,
) -> None:
    """Store float rows ``src`` ``[R, D]`` into ``dst`` uint8 ``[R, row_bytes(D)]``, a chunk of rows
    at a time (no fp32 copy of the whole table). ``row_min`` / ``row_max``: the whole rows' ranges
    when ``src`` is a column block (``quantize_rows``)."""
    if dst.shape != (src.size(0), row_bytes(src.size(1), storage)):
        raise ValueError(
            f"{storage} rows of {tuple(src.shape)} need a [{src.size(0)}, {row_bytes(src.size(1), storage)}] "
            f"buffer, got {tuple(dst.shape)}"
        )
    for start in range(0, src.size(0), _CHUNK_ROWS):
        end = min(start + _CHUNK_ROWS, src.size(0))
        low = None if row_min is None else row_min[start:end]
        high = None if row_max is None else row_max[start:end]
        dst[start:end].copy_(quantize_rows(src[start:end].to(dst.device), storage, low, high))


class QuantGroupedEmbeddingLookup(GroupedEmbeddingLookup):
    """Quantized shards of one width and data type in the uint8 buffer ``weight``.

    Args:
        shards: as for ``GroupedEmbeddingLookup``; all of one ``data_type`` (any ``DataType``).
        pooled: bags or one row per id.
        device: where the buffer lives (``meta``: allocate later with ``to_empty``).
        fused_optimizer: must be None (inference only); the argument keeps the base's signature.

    forward: as ``GroupedEmbeddingLookup.forward``, returning fp32.
    """

    def __init__(
        self,
        shards: Sequence[ShardSpec],
        pooled: bool,
        device: Optional[torch.device] = None,
        fused_optimizer: Optional[FusedOptimizerConfig] = None,
    ) -> None:
        if fused_optimizer is not None:
            raise ValueError("quantized tables serve inference only: they take no fused optimizer")
        data_types = {s.config.data_type for s in shards}
        if len(data_types) > 1:
            raise ValueError(
                f"a quantized group stores one data type, got {sorted(d.value for d in data_types)}"
            )
        super().__init__(shards, pooled, torch.device("meta"))
        self.storage = storage_of(data_types.pop())
        del self.weight  # the base's float parameter (on meta): the rows live in a byte buffer instead
        width = row_bytes(self.embedding_dim, self.storage)
        self.register_buffer(
            "weight", torch.zeros(self.row_offsets[-1], width, dtype=torch.uint8, device=device)
        )
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each shard initialized by its table config (in fp32), then quantized."""
        for i, shard in enumerate(self.shards):
            rows = torch.empty(shard.num_rows, shard.num_cols, device=self.weight.device)
            shard.config.init_weight_(rows)
            quantize_into(self.shard_rows(i), rows, self.storage)

    def _meta_output(self, ids, bags_per_feature, batch_major) -> torch.Tensor:
        return super()._meta_output(ids, bags_per_feature, batch_major).to(torch.float32)

    def _run_kernel(self, ids, offsets, bag_shift, weights, bag_scale, batch_major) -> torch.Tensor:
        return quant_embedding_forward(
            self.weight,
            self.storage,
            self.embedding_dim,
            ids,
            offsets,
            bag_shift,
            weights,
            bag_scale,
            self.pooled,
            batch_major,
        )


__all__ = ["QuantGroupedEmbeddingLookup", "quantize_into"]
