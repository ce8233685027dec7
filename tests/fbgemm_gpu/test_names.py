"""fbgemm's Python names of the run-as-torchrec mode (shardkit.fbgemm_gpu)."""

from __future__ import annotations

import importlib

import pytest
import torch

from shardkit.fbgemm_gpu import (
    split_table_batched_embeddings_ops,
    split_table_batched_embeddings_ops_common,
    split_table_batched_embeddings_ops_training,
)
from shardkit.fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from shardkit.fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, PoolingMode
from shardkit.modules import OptimType
from shardkit.sharding.fused_optimizer_config import fused_optimizer_config


def test_emb_optim_type_is_shardkits_optim_type_with_fbgemms_exact_members():
    assert EmbOptimType is OptimType
    assert EmbOptimType.EXACT_ROWWISE_ADAGRAD is OptimType.ROWWISE_ADAGRAD
    assert EmbOptimType.EXACT_ADAGRAD is OptimType.ADAGRAD and EmbOptimType.EXACT_SGD is OptimType.SGD
    config = fused_optimizer_config({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.5})
    assert config.optimizer is OptimType.ROWWISE_ADAGRAD and config.lr == 0.5
    with pytest.raises(AttributeError, match="PARTIAL_ROWWISE_ADAM"):
        EmbOptimType.PARTIAL_ROWWISE_ADAM  # noqa: B018 - no shardkit kernel


def test_sparse_type():
    codes = {
        SparseType.FP32: 0,
        SparseType.FP16: 1,
        SparseType.INT8: 2,
        SparseType.INT4: 3,
        SparseType.INT2: 4,
        SparseType.BF16: 5,
        SparseType.FP8: 6,
    }
    assert set(codes) == set(SparseType)
    for member, code in codes.items():
        assert member.as_int() == code and SparseType.from_int(code) is member
    assert str(SparseType.FP16) == "fp16" and SparseType("int8") is SparseType.INT8
    assert SparseType.FP16.as_dtype() == torch.float16 and SparseType.INT4.as_dtype() == torch.quint4x2
    assert SparseType.from_dtype(torch.bfloat16) is SparseType.BF16
    assert [SparseType.FP32.bit_rate(), SparseType.INT2.bit_rate()] == [32, 2]
    assert SparseType.BF16.is_float() and not SparseType.INT8.is_float()
    with pytest.raises(ValueError, match="unsupported sparse type code 9"):
        SparseType.from_int(9)
    with pytest.raises(ValueError, match="no SparseType for dtype torch.int64"):
        SparseType.from_dtype(torch.int64)


def test_pooling_and_bounds_check_modes_have_fbgemms_values():
    assert [(m.name, int(m)) for m in PoolingMode] == [("SUM", 0), ("MEAN", 1), ("NONE", 2)]
    assert PoolingMode.MEAN.do_pooling() and not PoolingMode.NONE.do_pooling()
    assert [(m.name, int(m)) for m in BoundsCheckMode] == [
        ("FATAL", 0),
        ("WARNING", 1),
        ("IGNORE", 2),
        ("NONE", 3),
    ]
    for module in (split_table_batched_embeddings_ops, split_table_batched_embeddings_ops_training):
        assert module.PoolingMode is PoolingMode and module.BoundsCheckMode is BoundsCheckMode


def test_cache_algorithm_is_shardkits_or_an_import_error_saying_it_is_missing():
    try:
        want = importlib.import_module("shardkit.sharding.cache_params").CacheAlgorithm
    except (ImportError, AttributeError):
        want = None
    for module in (
        split_table_batched_embeddings_ops_common,
        split_table_batched_embeddings_ops,
        split_table_batched_embeddings_ops_training,
    ):
        if want is not None:
            assert module.CacheAlgorithm is want
        else:
            with pytest.raises(
                ImportError, match=r"stands for shardkit.sharding.cache_params.CacheAlgorithm"
            ):
                module.CacheAlgorithm  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'EmbeddingLocation'"):
        split_table_batched_embeddings_ops_common.EmbeddingLocation  # noqa: B018
