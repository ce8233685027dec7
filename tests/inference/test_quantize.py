"""quantize_embeddings / quantize_inference_model: torchrec's calls, built on shardkit.quant's from_float.

Each swapped collection must be exactly what ``from_float`` makes of the trained module with the same
storages (byte-identical stored rows), per-table dtypes must land on their tables, the caller's float
module must be left alone unless ``inplace``, and what cannot be quantized is an error naming it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardkit.inference import quantize_embeddings, quantize_inference_model
from shardkit.inference.quantize import quant_config
from shardkit.models import DLRM
from shardkit.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FeatureProcessedEmbeddingBagCollection,
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
    PositionWeightedModule,
)
from shardkit.quant import (
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    QuantFeatureProcessedEmbeddingBagCollection,
    QuantManagedCollisionEmbeddingBagCollection,
    QuantManagedCollisionEmbeddingCollection,
)
from shardkit.sparse import KeyedJaggedTensor

ROWS = {"t_user": 20, "t_item": 30, "t_ctx": 10}


def _ebc() -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        [EmbeddingBagConfig(rows, 8, name=t, feature_names=[t[2:]]) for t, rows in ROWS.items()]
    )


def _dlrm() -> DLRM:
    torch.manual_seed(1)
    return DLRM(_ebc(), dense_in_features=4, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1])


def _kjt(features=("user", "item", "ctx"), seed=0) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(features) * 5,), generator=gen)
    rows = [ROWS[f"t_{f}"] for f in features for _ in range(5)]
    values = torch.cat([torch.randint(0, r, (int(n),), generator=gen) for r, n in zip(rows, lengths)])
    return KeyedJaggedTensor(list(features), values, lengths=lengths)


def test_quantize_inference_model_per_table_dtype_in_a_dlrm():
    model = _dlrm()
    trained = copy.deepcopy(model)
    dense, kjt = torch.randn(5, 4, generator=torch.Generator().manual_seed(3)), _kjt()
    quantized = quantize_inference_model(
        model, per_table_weight_dtype={"t_user": torch.quint4x2, "t_ctx": torch.float16}
    )
    assert quantized is model  # in place, as torchrec
    ebc = quantized.sparse_arch.embedding_bag_collection
    assert isinstance(ebc, QuantEmbeddingBagCollection)
    assert {t: ebc.table_storage(t) for t in ROWS} == {"t_user": "int4", "t_item": "int8", "t_ctx": "fp16"}
    # byte-identical to quantizing each table with from_float at its storage
    float_ebc = trained.sparse_arch.embedding_bag_collection
    for table, data_type in [("t_user", DataType.INT4), ("t_item", DataType.INT8), ("t_ctx", DataType.FP16)]:
        alone = QuantEmbeddingBagCollection.from_float(float_ebc, data_type=data_type)
        assert torch.equal(ebc.table_weight(table), alone.table_weight(table)), table
    # the dense layers are untouched; the answers are the float model's within the quantization error
    assert torch.equal(quantized.over_arch.model[1].weight, trained.over_arch.model[1].weight)
    with torch.inference_mode():
        got, want = quantized(dense, kjt), trained(dense, kjt)
    assert got.shape == want.shape and not torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=0, atol=0.05)


def test_quantize_embeddings_int2_fp16_output_not_inplace():
    model = _dlrm()
    quantized = quantize_embeddings(model, torch.quint2x4, inplace=False, output_dtype=torch.float16)
    assert type(model.sparse_arch.embedding_bag_collection) is EmbeddingBagCollection  # left alone
    assert not hasattr(model.sparse_arch.embedding_bag_collection, "qconfig")
    ebc = quantized.sparse_arch.embedding_bag_collection
    assert [ebc.table_storage(t) for t in ROWS] == ["int2"] * 3 and ebc.output_dtype == torch.float16
    with torch.inference_mode():
        assert ebc(_kjt()).values().dtype == torch.float16
    alone = QuantEmbeddingBagCollection.from_float(model.sparse_arch.embedding_bag_collection, DataType.INT2)
    assert all(torch.equal(ebc.table_weight(t), alone.table_weight(t)) for t in ROWS)


def test_sequence_collection_by_default_mapping_and_by_additional_keys():
    torch.manual_seed(0)
    ec = EmbeddingCollection(
        [EmbeddingConfig(rows, 4, name=t, feature_names=[t[2:]]) for t, rows in ROWS.items()]
    )
    root = torch.nn.ModuleDict({"ec": copy.deepcopy(ec)})
    quantize_inference_model(root, quantization_dtype=torch.float16)
    assert isinstance(root["ec"], QuantEmbeddingCollection)
    assert [root["ec"].table_storage(t) for t in ROWS] == ["fp16"] * 3
    # quantize_embeddings quantizes only EmbeddingBagCollection unless told (torchrec's default spec)
    other = quantize_embeddings(torch.nn.ModuleDict({"ec": ec}), torch.int8, inplace=False)
    assert type(other["ec"]) is EmbeddingCollection
    other = quantize_embeddings(
        torch.nn.ModuleDict({"ec": ec}),
        torch.int8,
        inplace=False,
        additional_qconfig_spec_keys=[EmbeddingCollection],
        additional_mapping={EmbeddingCollection: QuantEmbeddingCollection},
    )
    assert isinstance(other["ec"], QuantEmbeddingCollection) and other["ec"].table_storage("t_user") == "int8"


def test_feature_processed_collection_gets_fp_weight_dtype():
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(ROWS["t_user"], 4, name="t_user", feature_names=["user"])], is_weighted=True
    )
    fp = FeatureProcessedEmbeddingBagCollection(ebc, {"user": PositionWeightedModule(max_feature_length=4)})
    root = torch.nn.ModuleDict({"fp": fp, "plain": _ebc()})
    quantize_inference_model(root, fp_weight_dtype=torch.quint4x2, quantization_dtype=torch.float16)
    assert isinstance(root["fp"], QuantFeatureProcessedEmbeddingBagCollection)
    assert root["fp"].embedding_bag_collection.table_storage("t_user") == "int4"
    assert isinstance(root["plain"], QuantEmbeddingBagCollection)
    assert root["plain"].table_storage("t_user") == "fp16"


def _mc(pooled: bool):
    """A float MC module whose maps hold slots (a few training-mode passes), then in eval."""
    config_type = EmbeddingBagConfig if pooled else EmbeddingConfig
    tables = [config_type(6, 4, name=f"t_{k}", feature_names=[k]) for k in ("a", "b")]
    mc = ManagedCollisionCollection(
        {t.name: MCHManagedCollisionModule(6, None, LFU_EvictionPolicy(), 1, 1000) for t in tables}, tables
    )
    if pooled:
        module = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables), mc)
    else:
        module = ManagedCollisionEmbeddingCollection(EmbeddingCollection(tables), mc)
    for seed in range(3):
        module(_mc_kjt(seed))
    return module.eval()


def _mc_kjt(seed: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (2 * 4,), generator=gen)
    return KeyedJaggedTensor(
        ["a", "b"], torch.randint(0, 1000, (int(lengths.sum()),), generator=gen), lengths=lengths
    )


@pytest.mark.parametrize("pooled", [True, False], ids=["ebc", "ec"])
def test_managed_collision_modules_become_quantized_mc_modules(pooled):
    mc_type = ManagedCollisionEmbeddingBagCollection if pooled else ManagedCollisionEmbeddingCollection
    quant_type = (
        QuantManagedCollisionEmbeddingBagCollection if pooled else QuantManagedCollisionEmbeddingCollection
    )
    root = torch.nn.ModuleDict({"mc": _mc(pooled)})
    trained = copy.deepcopy(root["mc"])
    quantize_inference_model(root, per_table_weight_dtype={"t_b": torch.quint4x2})
    served = root["mc"]
    assert type(served) is quant_type
    assert served.table_storage("t_a") == "int8" and served.table_storage("t_b") == "int4"
    # the same as from_float of the trained module with those storages: byte-identical rows
    trained._embedding_module.qconfig = quant_config(
        torch.int8, per_table_weight_dtype={"t_b": torch.quint4x2}
    )
    reference = quant_type.from_float(trained)
    for table in ("t_a", "t_b"):
        assert torch.equal(served.table_weight(table), reference.table_weight(table)), table
    for seed in range(10, 13):
        got, want = served(_mc_kjt(seed)), reference(_mc_kjt(seed))
        if pooled:
            assert torch.equal(got.values(), want.values())
        else:
            assert all(torch.equal(got[k].values(), want[k].values()) for k in want)
    # quantize_embeddings with the sequence type as an additional key does the same; not in place
    float_root = torch.nn.ModuleDict({"mc": _mc(pooled)})
    keys = [] if pooled else [EmbeddingCollection]
    mapping = {} if pooled else {EmbeddingCollection: QuantEmbeddingCollection}
    out = quantize_embeddings(
        float_root,
        torch.float16,
        inplace=False,
        additional_qconfig_spec_keys=keys,
        additional_mapping=mapping,
    )
    assert type(out["mc"]) is quant_type and out["mc"].table_storage("t_a") == "fp16"
    assert type(float_root["mc"]) is mc_type
    assert not hasattr(float_root["mc"]._embedding_module, "qconfig")


def test_bad_dtypes_and_table_names_are_errors():
    with pytest.raises(ValueError, match="no quantized table storage for dtype torch.int32"):
        quantize_embeddings(_dlrm(), torch.int32, inplace=False)
    with pytest.raises(ValueError, match=r"per_table_weight_dtype\['t_user'\]: no quantized table storage"):
        quantize_inference_model(_dlrm(), per_table_weight_dtype={"t_user": torch.int64})
    with pytest.raises(ValueError, match=r"names tables \['t_nope'\] that no collection to quantize has"):
        quantize_inference_model(_dlrm(), per_table_weight_dtype={"t_nope": torch.int8})
