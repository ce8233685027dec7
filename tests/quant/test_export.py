"""torch.export of the quantized lookup: a group of quantized tables exports (ids of any count), on the
pure-torch and the native backend, and the exported program computes what the module does.

(The KeyedJaggedTensor-level collections do not export: docs/quant.md says why.)
"""

from __future__ import annotations

import pytest
import torch

from shardkit.distributed.validation import set_validation, validation_enabled
from shardkit.kernels import kernel_backend, native_ops
from shardkit.modules import DataType, EmbeddingBagConfig, PoolingType, ShardSpec
from shardkit.quant import QuantGroupedEmbeddingLookup

BACKENDS = ["torch"] + (["native"] if native_ops() is not None else [])


class _Lookup(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        configs = [
            EmbeddingBagConfig(100, 8, name="a", feature_names=["f1", "f2"], data_type=DataType.INT4),
            EmbeddingBagConfig(
                50, 8, name="b", feature_names=["f3"], data_type=DataType.INT4, pooling=PoolingType.MEAN
            ),
        ]
        self.group = QuantGroupedEmbeddingLookup([ShardSpec(c) for c in configs], pooled=True)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.group(ids, offsets, [2, 2, 2], sample_major=True)  # 3 features, batch 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_lookup_exports(backend):
    module = _Lookup()
    ids, offsets = torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([0, 1, 3, 3, 4, 6, 7])
    before = validation_enabled()
    set_validation(False)  # the id check reads the ids on the host
    try:
        with kernel_backend(backend):
            program = torch.export.export(
                module,
                (ids, offsets),
                dynamic_shapes={"ids": {0: torch.export.Dim("n", min=2)}, "offsets": None},
            )
            for some_ids, some_offsets in [
                (ids, offsets),
                (torch.tensor([9, 2, 3, 49]), torch.tensor([0, 1, 1, 2, 3, 3, 4])),
            ]:
                got = program.module()(some_ids, some_offsets)
                assert got.shape == (2, 24) and torch.equal(got, module(some_ids, some_offsets))
    finally:
        set_validation(before)
