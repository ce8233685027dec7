"""prune_inference_model: a quantized DLRM's tables pruned in place, served through DLRMPredictModule
with ids in the original ranges; answers equal the unpruned quantized model with dropped rows zeroed."""

from __future__ import annotations

import copy

import pytest
import torch

from shardkit.inference import DLRMPredictModule, Request, quantize_inference_model
from shardkit.inference.pruning import prune_inference_model
from shardkit.models import DLRM
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig
from shardkit.quant.pruning import PrunedQuantEmbeddings

ROWS = {"t_user": 20, "t_item": 30}


def _quantized_dlrm() -> DLRM:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(r, 8, name=t, feature_names=[t[2:]]) for t, r in ROWS.items()]
    )
    return quantize_inference_model(DLRM(ebc, 4, [16, 8], [8, 1]))


def _requests():
    gen = torch.Generator().manual_seed(3)
    return [
        Request(
            sparse={
                "user": torch.randint(0, 20, (i % 3,), generator=gen),
                "item": torch.randint(0, 30, (2,), generator=gen),
            },
            dense=torch.randn(4, generator=gen),
        )
        for i in range(7)
    ]


def test_pruned_model_answers_as_the_zeroed_model():
    model = _quantized_dlrm()
    reference = copy.deepcopy(model)
    keep = [0, 5, 7, 19]
    with torch.no_grad():
        dropped = torch.ones(20, dtype=torch.bool)
        dropped[keep] = False
        reference.sparse_arch.embedding_bag_collection.table_weight("t_user")[dropped] = 0
    pruned, report = prune_inference_model(model, keep_rows={"t_user": keep})
    assert isinstance(pruned.sparse_arch.embedding_bag_collection, PrunedQuantEmbeddings)
    assert [(t.name, t.kept, t.rows) for t in report.tables] == [("t_user", 4, 20), ("t_item", 30, 30)]
    assert report.bytes_saved > 0
    got = DLRMPredictModule(pruned, 4).answer(_requests())  # request checks use the original ranges
    want = DLRMPredictModule(reference, 4).answer(_requests())
    assert all(g.ok for g in got)
    assert all(torch.equal(g.result["default"], w.result["default"]) for g, w in zip(got, want))


def test_bad_table_names_and_arguments():
    with pytest.raises(ValueError, match=r"names tables \['t_nope'\] that no quantized collection"):
        prune_inference_model(_quantized_dlrm(), keep_rows={"t_nope": [0]})
    with pytest.raises(ValueError, match="exactly one of keep_rows and row_norm_threshold"):
        prune_inference_model(_quantized_dlrm())
