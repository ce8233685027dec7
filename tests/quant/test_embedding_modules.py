"""Unsharded quantized collections: from_float, pooled and sequence lookups, state, inference only.

The reference of a quantized module is its float twin holding the *dequantized* tables: the pooled
outputs must equal it within fp32 rounding (same fp32 values summed in the same order). Against the
trained float module the error of a bag is bounded by the sum of its rows' round-trip bounds.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from shardkit.kernels.quant_rows import dequantize_rows, row_bytes, row_scale_bias
from shardkit.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FeatureProcessedEmbeddingBagCollection,
    FusedOptimizerConfig,
    OptimType,
    PoolingType,
    PositionWeightedModule,
    PositionWeightedModuleCollection,
    ShardSpec,
)
from shardkit.quant import (
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    QuantFeatureProcessedEmbeddingBagCollection,
    QuantGroupedEmbeddingLookup,
)
from shardkit.sparse import KeyedJaggedTensor
from tests.modules._inputs import random_kjt

ROWS = {"a": 30, "b": 30, "c": 17, "d": 9}


def _bag_tables(pooling=PoolingType.SUM):
    return [
        EmbeddingBagConfig(
            30, 8, name="t_int8", feature_names=["a", "b"], data_type=DataType.INT8, pooling=pooling
        ),
        EmbeddingBagConfig(17, 7, name="t_int4", feature_names=["c"], data_type=DataType.INT4),
        EmbeddingBagConfig(
            9, 8, name="t_int2", feature_names=["d"], data_type=DataType.INT2, pooling=pooling
        ),
    ]


def _dequantized_twin(quant, float_cls, configs, **kwargs):
    """The float module holding the quantized module's tables, dequantized to fp32."""
    twin = float_cls([dataclasses.replace(c, data_type=DataType.FP32) for c in configs], **kwargs)
    with torch.no_grad():
        for c in configs:
            stored = quant.table_weight(c.name)
            twin.table_weight(c.name).copy_(
                dequantize_rows(stored, c.embedding_dim, quant.table_storage(c.name))
            )
    return twin


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_equals_dequantized_tables(pooling, weighted):
    trained = EmbeddingBagCollection(_bag_tables(pooling), is_weighted=weighted)
    quant = QuantEmbeddingBagCollection.from_float(trained)
    assert [quant.table_storage(t) for t in ("t_int8", "t_int4", "t_int2")] == ["int8", "int4", "int2"]
    assert list(quant.parameters()) == []
    features = random_kjt(ROWS, batch=6, weighted=weighted, seed=4, keys=["d", "c", "b", "a"])
    out = quant(features)
    twin = _dequantized_twin(
        quant, EmbeddingBagCollection, quant.embedding_bag_configs(), is_weighted=weighted
    )
    ref = twin(features)
    assert out.keys() == ref.keys() == ["a", "b", "c", "d"] and out.values().dtype == torch.float32
    assert not out.values().requires_grad
    torch.testing.assert_close(out.values(), ref.values().detach(), rtol=1e-6, atol=1e-6)
    # against the trained module: at most the bag's (weighted, mean) pooling of its rows' scale / 2
    bound = _dequantized_twin(
        quant, EmbeddingBagCollection, quant.embedding_bag_configs(), is_weighted=weighted
    )
    with torch.no_grad():
        for c in quant.embedding_bag_configs():
            scale = row_scale_bias(quant.table_weight(c.name), c.embedding_dim, quant.table_storage(c.name))[
                :, :1
            ]
            bound.table_weight(c.name).copy_((scale / 2 + 1e-6).expand(-1, c.embedding_dim))
    error = (out.values() - trained(features).values().detach()).abs()
    assert bool((error <= bound(features).values().detach()).all())


def test_from_float_data_type_sources():
    tables = [
        EmbeddingBagConfig(10, 4, name="x", feature_names=["x"]),
        EmbeddingBagConfig(10, 4, name="y", feature_names=["y"], data_type=DataType.FP16),
    ]
    trained = EmbeddingBagCollection(tables)
    # the configs' own data types
    assert [QuantEmbeddingBagCollection.from_float(trained).table_storage(n) for n in "xy"] == [
        "fp32",
        "fp16",
    ]
    # one data type for every table
    forced = QuantEmbeddingBagCollection.from_float(trained, data_type=DataType.INT4)
    assert [forced.table_storage(n) for n in "xy"] == ["int4", "int4"]
    assert forced.table_weight("x").shape == (10, row_bytes(4, "int4"))
    # torchrec's qconfig: the weight observer's dtype, per_table_weight_dtype overriding it
    trained.qconfig = SimpleNamespace(
        weight=lambda: SimpleNamespace(dtype=torch.qint8),
        activation=lambda: SimpleNamespace(dtype=torch.float16),
        per_table_weight_dtype={"y": torch.quint2x4},
    )
    by_qconfig = QuantEmbeddingBagCollection.from_float(trained)
    assert [by_qconfig.table_storage(n) for n in "xy"] == ["int8", "int2"]
    assert by_qconfig.output_dtype == torch.float16
    out = by_qconfig(random_kjt({"x": 10, "y": 10}, batch=3))
    assert out.values().dtype == torch.float16
    trained.qconfig.weight = lambda: SimpleNamespace(dtype=torch.int32)
    with pytest.raises(ValueError, match="no quantized table storage for dtype torch.int32"):
        QuantEmbeddingBagCollection.from_float(trained)


def test_sequence_lookup_equals_dequantized_rows():
    configs = [
        EmbeddingConfig(30, 6, name="s8", feature_names=["a", "b"], data_type=DataType.INT8),
        EmbeddingConfig(17, 6, name="s16", feature_names=["c"], data_type=DataType.BF16),
    ]
    trained = EmbeddingCollection(configs)
    quant = QuantEmbeddingCollection.from_float(trained, output_dtype=torch.float16)
    features = random_kjt({k: ROWS[k] for k in "abc"}, batch=5, seed=2)
    out = quant(features)
    ref = _dequantized_twin(quant, EmbeddingCollection, quant.embedding_configs())(features)
    assert list(out) == ["a", "b", "c"]
    for key in out:
        assert out[key].values().dtype == torch.float16
        torch.testing.assert_close(out[key].values(), ref[key].values().detach().half())
        assert torch.equal(out[key].lengths(), ref[key].lengths())


@pytest.mark.parametrize("form", ["dict", "collection"])
def test_feature_processed_collection(form):
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(30, 8, name="t", feature_names=["a", "b"], data_type=DataType.INT8)],
        is_weighted=True,
    )
    # torchrec's two forms: a dict of per-feature modules, or one processor collection
    if form == "dict":
        processors = {"a": PositionWeightedModule(4)}
        weights = processors["a"].position_weight
    else:
        processors = PositionWeightedModuleCollection({"a": 4})
        weights = processors.position_weights["a"]
    with torch.no_grad():
        weights.copy_(torch.tensor([1.0, 0.5, 2.0, 3.0]))
    trained = FeatureProcessedEmbeddingBagCollection(ebc, processors)
    quant = QuantFeatureProcessedEmbeddingBagCollection.from_float(trained)
    assert isinstance(quant.embedding_bag_collection, QuantEmbeddingBagCollection)
    assert isinstance(quant._feature_processors, type(trained._feature_processors))
    features = random_kjt({"a": 30, "b": 30}, batch=4, seed=7)
    twin = FeatureProcessedEmbeddingBagCollection(
        _dequantized_twin(
            quant.embedding_bag_collection,
            EmbeddingBagCollection,
            ebc.embedding_bag_configs(),
            is_weighted=True,
        ),
        processors,
    )
    torch.testing.assert_close(
        quant(features).values(), twin(features).values().detach(), rtol=1e-6, atol=1e-6
    )


def test_state_dict_round_trip_and_torchrec_weights():
    trained = EmbeddingBagCollection(_bag_tables())
    quant = QuantEmbeddingBagCollection.from_float(trained)
    state = quant.state_dict()
    assert {k: (v.dtype, tuple(v.shape)) for k, v in state.items()} == {
        "embedding_bags.t_int8.weight": (torch.uint8, (30, 12)),
        "embedding_bags.t_int4.weight": (torch.uint8, (17, 8)),
        "embedding_bags.t_int2.weight": (torch.uint8, (9, 6)),
    }
    fresh = QuantEmbeddingBagCollection(quant.embedding_bag_configs())
    fresh.load_state_dict(state)
    features = random_kjt(ROWS, batch=5, seed=1)
    assert torch.equal(fresh(features).values(), quant(features).values())
    # torchrec's (values, scale_bias) pairs
    pairs = {k.split(".")[1]: (v[:, :-4], v[:, -4:]) for k, v in state.items()}
    again = QuantEmbeddingBagCollection(quant.embedding_bag_configs(), table_name_to_quantized_weights=pairs)
    assert torch.equal(again(features).values(), quant(features).values())
    pairs["t_int4"] = (pairs["t_int4"][0][:, :3], pairs["t_int4"][1])
    with pytest.raises(ValueError, match="table 't_int4': quantized rows must be uint8 \\(17, 8\\)"):
        QuantEmbeddingBagCollection(quant.embedding_bag_configs(), table_name_to_quantized_weights=pairs)


def test_inference_only():
    quant = QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(_bag_tables()))
    features = random_kjt(ROWS, batch=3, seed=9)
    with torch.inference_mode():
        out = quant(features)
    assert out.values().is_inference() and out.values().shape == (3, 8 + 8 + 7 + 8)
    with pytest.raises(ValueError, match="no fused optimizer"):
        QuantGroupedEmbeddingLookup(
            [ShardSpec(_bag_tables()[0])], True, None, FusedOptimizerConfig(OptimType.SGD)
        )


def test_bad_ids_name_the_feature():
    quant = QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(_bag_tables()))
    features = random_kjt(ROWS, batch=3, seed=9)
    values = features.values().clone()
    values[-1] = 9  # the last id belongs to feature d, whose table has 9 rows
    bad = KeyedJaggedTensor.from_lengths_sync(features.keys(), values, features.lengths())
    with pytest.raises(IndexError, match="id 9 of feature 'd' is out of range for table 't_int2'"):
        quant(bad)
