"""Unsharded modules on a batch of zero samples (a KJT of stride 0, e.g. the last batch of an epoch).

Every module gives the output of its non-empty batches with no rows: same keys, same widths
(``[0, sum of dims]`` pooled, ``[0, dim]`` per feature sequence), a backward that runs and changes no
table, and training afterwards equal to a module that never saw the empty batch. Issue 23 (the
pooled collections built ``[0, dim]`` instead of ``[0, features * dim]``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardkit.kernels.quant_rows import pack_codes, unpack_codes
from shardkit.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FeatureProcessedEmbeddingBagCollection,
    FusedOptimizerConfig,
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
    OptimType,
    PoolingType,
    PositionWeightedModule,
)
from shardkit.quant import (
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    QuantFeatureProcessedEmbeddingBagCollection,
)
from shardkit.sparse import KeyedJaggedTensor
from tests.modules._inputs import random_kjt

# two features on one table and tables of different widths: the output width is not one table's
ROWS = {"a": 10, "b": 10, "c": 7}
KEYS = list(ROWS)


def _bag_configs(data_type: DataType = DataType.FP32):
    return [
        EmbeddingBagConfig(10, 5, name="t0", feature_names=["a", "b"], data_type=data_type),
        EmbeddingBagConfig(
            7, 3, name="t1", feature_names=["c"], pooling=PoolingType.MEAN, data_type=data_type
        ),
    ]


def _configs(data_type: DataType = DataType.FP32):
    return [
        EmbeddingConfig(10, 4, name="t0", feature_names=["a", "b"], data_type=data_type),
        EmbeddingConfig(7, 4, name="t1", feature_names=["c"], data_type=data_type),
    ]


def _ebc(weighted: bool = False, data_type: DataType = DataType.FP32) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    optimizer = FusedOptimizerConfig(OptimType.SGD, lr=0.1)
    return EmbeddingBagCollection(_bag_configs(data_type), is_weighted=weighted, fused_optimizer=optimizer)


def _ec(data_type: DataType = DataType.FP32) -> EmbeddingCollection:
    torch.manual_seed(0)
    return EmbeddingCollection(
        _configs(data_type), fused_optimizer=FusedOptimizerConfig(OptimType.SGD, lr=0.1)
    )


def _zero(weighted: bool = False, keys=KEYS) -> KeyedJaggedTensor:
    """Zero samples: no lengths, no ids (stride 0)."""
    none = torch.zeros(0, dtype=torch.int64)
    kjt = KeyedJaggedTensor(keys, none, torch.zeros(0) if weighted else None, lengths=none)
    assert kjt.stride() == 0
    return kjt


def _zero_variable_batch(keys=KEYS) -> KeyedJaggedTensor:
    """Zero samples in the variable-batch form: no bags per key, ``[F, 0]`` inverse indices."""
    none = torch.zeros(0, dtype=torch.int64)
    return KeyedJaggedTensor(
        keys,
        none,
        lengths=none,
        stride_per_key_per_rank=[[0] for _ in keys],
        inverse_indices=(keys, torch.zeros(len(keys), 0, dtype=torch.int64)),
    )


def _batch(seed: int, weighted: bool = False) -> KeyedJaggedTensor:
    return random_kjt(ROWS, batch=3, weighted=weighted, seed=seed)


def _pooled_like(out, full) -> None:
    """``out`` is ``full``'s pooled output with no rows."""
    assert out.keys() == full.keys()
    assert out.length_per_key() == full.length_per_key()
    assert out.values().shape == (0, full.values().shape[1])


def _train(module, batches) -> None:
    for kjt in batches:
        out = module(kjt)
        values = out.values() if hasattr(out, "values") and callable(out.values) else out
        values.sum().backward()


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("variable_batch", [False, True])
def test_ebc_zero_samples_keep_widths_and_train_as_if_skipped(weighted, variable_batch):
    module = _ebc(weighted)
    skipped = copy.deepcopy(module)
    full = module(_batch(0, weighted))
    zero = _zero_variable_batch() if variable_batch else _zero(weighted)
    if variable_batch and weighted:
        zero = KeyedJaggedTensor(
            KEYS,
            zero.values(),
            torch.zeros(0),
            lengths=zero.lengths(),
            stride_per_key_per_rank=zero.stride_per_key_per_rank(),
            inverse_indices=zero.inverse_indices(),
        )
    out = module(zero)
    _pooled_like(out, full)
    assert out.values().requires_grad  # in the graph: a training loop's backward runs as usual
    out.values().sum().backward()
    for name in ("t0", "t1"):
        assert torch.equal(module.table_weight(name), skipped.table_weight(name))
    _train(module, [_batch(1, weighted)])
    _train(skipped, [_batch(1, weighted)])
    for name in ("t0", "t1"):
        torch.testing.assert_close(module.table_weight(name), skipped.table_weight(name))


def test_ec_zero_samples_give_empty_sequences_per_feature():
    module = _ec()
    out = module(_zero())
    assert list(out.keys()) == KEYS
    for key in KEYS:
        assert out[key].values().shape == (0, 4)
        assert out[key].lengths().numel() == 0
    loss = sum(out[key].values().sum() for key in KEYS)
    loss.backward()
    assert torch.equal(module.table_weight("t0"), _ec().table_weight("t0"))


def test_position_weighted_zero_samples():
    torch.manual_seed(0)
    module = FeatureProcessedEmbeddingBagCollection(_ebc(weighted=True), {"a": PositionWeightedModule(4)})
    full = module(_batch(0, weighted=True))
    out = module(_zero(weighted=True))
    _pooled_like(out, full)
    out.values().sum().backward()
    quantized = QuantFeatureProcessedEmbeddingBagCollection.from_float(module)
    _pooled_like(quantized(_zero(weighted=True)), full)


def _mc(pooled: bool):
    torch.manual_seed(0)
    configs = _bag_configs() if pooled else _configs()
    modules = {
        c.name: MCHManagedCollisionModule(c.num_embeddings, None, LFU_EvictionPolicy(), 1, 1000, name=c.name)
        for c in configs
    }
    optimizer = FusedOptimizerConfig(OptimType.SGD, lr=0.1)
    inner = (
        EmbeddingBagCollection(configs, fused_optimizer=optimizer)
        if pooled
        else EmbeddingCollection(configs, fused_optimizer=optimizer)
    )
    kind = ManagedCollisionEmbeddingBagCollection if pooled else ManagedCollisionEmbeddingCollection
    return kind(inner, ManagedCollisionCollection(modules, configs), return_remapped_features=True)


@pytest.mark.parametrize("pooled", [True, False])
def test_managed_collision_zero_samples(pooled):
    module = _mc(pooled)
    full, _ = module(_batch(0))
    out, remapped = module(_zero())
    assert remapped.stride() == 0 and remapped.values().numel() == 0
    if pooled:
        _pooled_like(out, full)
        out.values().sum().backward()
    else:
        assert all(out[key].values().shape == (0, 4) for key in KEYS)


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.INT2])
def test_quantized_zero_samples(data_type):
    ebc = QuantEmbeddingBagCollection.from_float(_ebc(data_type=data_type))
    _pooled_like(ebc(_zero()), ebc(_batch(0)))
    ec = QuantEmbeddingCollection.from_float(_ec(data_type=data_type))
    out = ec(_zero())
    assert all(out[key].values().shape == (0, 4) for key in KEYS)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_unpack_codes_of_no_rows(bits):
    codes = torch.zeros(0, 5, dtype=torch.uint8)
    assert unpack_codes(pack_codes(codes, bits), 5, bits).shape == (0, 5)
