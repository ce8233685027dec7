"""torch.export of the quantized lookup: a group of quantized tables, and the collections with a
KeyedJaggedTensor input, export (ids of any count), on the pure-torch and the native backend, and the
exported program computes what the module does.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from shardkit.distributed.validation import set_validation, validation_enabled
from shardkit.kernels import kernel_backend, native_ops
from shardkit.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    PoolingType,
    ShardSpec,
)
from shardkit.quant import QuantEmbeddingBagCollection, QuantEmbeddingCollection, QuantGroupedEmbeddingLookup
from shardkit.sparse import KeyedJaggedTensor

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


def _kjt(keys, values, lengths):
    return KeyedJaggedTensor.from_lengths_sync(keys, torch.tensor(values), torch.tensor(lengths))


class _Pooled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        configs = [
            EmbeddingBagConfig(100, 8, name="a", feature_names=["f1", "f2"], data_type=DataType.INT8),
            EmbeddingBagConfig(
                50, 4, name="b", feature_names=["f3"], data_type=DataType.INT4, pooling=PoolingType.MEAN
            ),
        ]
        self.ebc = QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(configs))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.ebc(kjt).values()


class _Sequence(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        configs = [EmbeddingConfig(100, 8, name="a", feature_names=["f1", "f2"], data_type=DataType.INT2)]
        self.ec = QuantEmbeddingCollection.from_float(EmbeddingCollection(configs))

    def forward(self, kjt: KeyedJaggedTensor) -> list:
        out = self.ec(kjt)
        return [out["f1"].values(), out["f2"].values()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_collections_export_with_a_keyed_jagged_tensor_input(backend):
    # the KJT is a pytree input; the number of ids is dynamic, the batch and the keys are not
    cases = [
        (
            _Pooled(),
            _kjt(["f1", "f2", "f3"], [1, 2, 3, 4, 5, 6, 7], [1, 2, 0, 2, 1, 1]),
            [_kjt(["f1", "f2", "f3"], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 49], [3, 0, 4, 1, 2, 1])],
        ),
        (
            _Sequence(),
            _kjt(["f1", "f2"], [1, 2, 3], [1, 2, 0, 0]),
            [_kjt(["f1", "f2"], [5, 6, 7, 8, 9], [0, 3, 1, 1])],
        ),
    ]
    before = validation_enabled()
    set_validation(False)
    try:
        with kernel_backend(backend):
            for module, example, others in cases:
                leaves = pytree.tree_leaves(example)
                spec = [{0: torch.export.Dim.DYNAMIC}] + [None] * (len(leaves) - 1)  # the values
                program = torch.export.export(module, (example,), dynamic_shapes={"kjt": spec}, strict=False)
                for kjt in [example, *others]:
                    got, want = program.module()(kjt), module(kjt)
                    got = got if isinstance(got, list) else [got]
                    want = want if isinstance(want, list) else [want]
                    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    finally:
        set_validation(before)


def test_quantized_lookup_exports_with_validation_on():
    # the id check reads the ids on the host: it steps aside while exporting (no set_validation
    # needed), and the eager module still checks
    module = _Lookup()
    ids, offsets = torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([0, 1, 3, 3, 4, 6, 7])
    assert validation_enabled()
    program = torch.export.export(
        module, (ids, offsets), dynamic_shapes={"ids": {0: torch.export.Dim("n", min=2)}, "offsets": None}
    )
    other_ids, other_offsets = torch.tensor([9, 2, 3, 49, 0]), torch.tensor([0, 1, 1, 2, 3, 4, 5])
    assert torch.equal(program.module()(other_ids, other_offsets), module(other_ids, other_offsets))
    with pytest.raises(IndexError, match="feature 'f3'"):
        module(torch.tensor([9, 2, 3, 49, 50]), other_offsets)
