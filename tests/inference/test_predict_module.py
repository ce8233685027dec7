"""PredictModule: requests batched into a KJT, one forward, results split back; bad requests refused alone.

The good requests' answers must equal the model run on a batch of exactly those samples; each bad one
gets its own error, and a batch with no good request still runs (a zero-sample forward), which is
what lets the ranks of a sharded model keep calling forward together.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from shardkit.inference import (
    BatchingMetadata,
    DLRMPredictModule,
    PredictFactory,
    PredictModule,
    Request,
    RequestBatcher,
    load_package,
    quantize_inference_model,
    save_package,
    shard_quant_model,
    split_results,
)
from shardkit.models import DLRM
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig
from shardkit.sparse import KeyedJaggedTensor, KeyedTensor
from shardkit.testing import run_world

ROWS = {"user": 20, "item": 30}


def _model() -> DLRM:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(rows, 8, name=f"t_{f}", feature_names=[f]) for f, rows in ROWS.items()]
    )
    model = DLRM(ebc, dense_in_features=3, dense_arch_layer_sizes=[8], over_arch_layer_sizes=[4, 1])
    return quantize_inference_model(model)


GOOD = [
    Request({"user": [1, 19], "item": torch.tensor([0, 29, 5])}, dense=[0.1, 0.2, 0.3]),
    Request({"item": [7]}, dense=torch.tensor([1.0, -1.0, 0.5])),  # no "user": an empty bag
    Request({}, dense=[0.0, 0.0, 1.0]),  # no ids at all
]
BAD = [
    (Request({"user": [1], "color": [3]}, dense=[0.0] * 3), r"unknown feature\(s\) \['color'\]"),
    (Request({"user": [1, 20]}, dense=[0.0] * 3), r"feature 'user': id 20 is out of range \[0, 20\)"),
    (Request({"item": [-1]}, dense=[0.0] * 3), r"feature 'item': id -1 is out of range \[0, 30\)"),
    (
        Request({"user": torch.tensor([1.0, 2.0])}, dense=[0.0] * 3),
        "ids must be integers, got a torch.float32",
    ),
    (Request({"user": [1, 2.5]}, dense=[0.0] * 3), "ids must be integers, got 2.5"),
    (Request({"user": [True]}, dense=[0.0] * 3), "ids must be integers, got True"),
    (Request({"user": [1]}), "the request has no dense features; the model takes 3"),
    (Request({"user": [1]}, dense=[0.0, 1.0]), r"dense features must have shape \[3\], got \[2\]"),
    (Request({"user": [1]}, dense=["a", "b", "c"]), "dense features must be 3 floats"),
    ("not a request", "a request is a Request"),
]


def _reference(model, requests):
    """The model on a batch built by hand from ``requests`` (all good)."""
    lengths, values = [], []
    for f in ROWS:
        for r in requests:
            ids = [int(i) for i in r.sparse.get(f, [])]
            lengths.append(len(ids))
            values += ids
    kjt = KeyedJaggedTensor(
        list(ROWS), torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths)
    )
    dense = torch.stack([torch.as_tensor(r.dense, dtype=torch.float32) for r in requests])
    with torch.inference_mode():
        return model(dense, kjt).reshape(-1)


def test_good_requests_answered_bad_ones_refused_alone():
    model = _model()
    served = DLRMPredictModule(copy.deepcopy(model), dense_in_features=3)
    requests = [GOOD[0], BAD[0][0], BAD[1][0], GOOD[1]] + [b for b, _ in BAD[2:]] + [GOOD[2]]
    answers = served.answer(requests)
    assert len(answers) == len(requests)
    expected = _reference(model, GOOD)
    good = [i for i, r in enumerate(requests) if any(r is g for g in GOOD)]
    for logit, i in zip(expected, good):
        assert answers[i].ok and torch.equal(answers[i].result["default"], logit), i
    bad = [i for i in range(len(requests)) if i not in good]
    for i, (_, message) in zip(bad, BAD):
        assert not answers[i].ok and answers[i].result is None
        assert answers[i].error.startswith(f"request {i}: ")
        assert re.search(message, answers[i].error), (answers[i].error, message)


def test_no_good_request_still_runs_a_zero_sample_forward():
    served = DLRMPredictModule(_model(), dense_in_features=3)
    calls = []
    served.register_forward_hook(lambda module, args, out: calls.append(args[0]["float_features"].shape))
    answers = served.answer([b for b, _ in BAD[:3]])
    assert [a.ok for a in answers] == [False] * 3 and calls == [torch.Size([0, 3])]
    assert served.answer([]) == [] and calls[-1] == torch.Size([0, 3])


def test_predict_forward_takes_torchrecs_batch_dict():
    model = _model()
    served = DLRMPredictModule(copy.deepcopy(model), dense_in_features=3)
    batch, good, errors = RequestBatcher(ROWS, 3).batch(GOOD)
    assert good == [0, 1, 2] and errors == {}
    assert batch["id_list_features.lengths"].tolist() == [2, 0, 0, 3, 1, 0]  # feature-major
    out = served(batch)
    assert torch.equal(out["default"], _reference(model, GOOD))
    assert not out["default"].requires_grad


def test_split_results_of_tensors_keyed_tensors_and_dicts():
    kt = KeyedTensor(["a", "b"], [2, 1], torch.arange(9.0).reshape(3, 3))
    rows = split_results(kt, 3)
    assert torch.equal(rows[1]["a"], torch.tensor([3.0, 4.0])) and torch.equal(
        rows[2]["b"], torch.tensor([8.0])
    )
    assert [float(r["x"]) for r in split_results({"x": torch.tensor([1.0, 2.0])}, 2)] == [1.0, 2.0]
    with pytest.raises(ValueError, match=r"a result of shape \[2\] for a batch of 3"):
        split_results(torch.zeros(2), 3)
    with pytest.raises(TypeError, match="cannot split a result of type str"):
        split_results("x", 1)


def test_base_class_without_batcher_says_so():
    class Echo(PredictModule):
        def predict_forward(self, batch):
            return batch

    with pytest.raises(NotImplementedError, match="Echo does not take Requests: define batcher"):
        Echo(torch.nn.Linear(1, 1)).answer([GOOD[0]])


def _sharded_worker() -> list:
    import torch.distributed as dist

    rank = dist.get_rank()
    reference = _model()
    sharded, _ = shard_quant_model(copy.deepcopy(reference), world_size=2)
    served = DLRMPredictModule(sharded, dense_in_features=3)
    # rank 1 gets only bad requests: its forward has zero samples, rank 0's goes on
    requests = GOOD if rank == 0 else [BAD[1][0]]
    answers = served.answer(requests)
    if rank == 0:
        expected = _reference(reference, GOOD)
        for answer, logit in zip(answers, expected):
            torch.testing.assert_close(answer.result["default"], logit, rtol=1e-5, atol=1e-5)
    else:
        assert not answers[0].ok and "out of range" in answers[0].error
    return [a.ok for a in answers]


def test_sharded_model_serves_with_a_rank_of_bad_requests():
    assert run_world(_sharded_worker, 2) == [[True, True, True], [False]]


def test_predict_factory_makes_the_module_and_describes_batching(tmp_path):
    save_package(_model(), tmp_path / "pkg")

    class Factory(PredictFactory):
        def create_predict_module(self):
            return DLRMPredictModule(load_package(tmp_path / "pkg"), dense_in_features=3)

        def batching_metadata(self):
            return {
                "float_features": BatchingMetadata("dense", "cpu", []),
                "id_list_features": BatchingMetadata("sparse", "cpu", ["lengths"]),
            }

        def result_metadata(self):
            return "dict_of_tensor"

    factory = Factory()
    module = factory.run_weights_dependent_transformations(
        factory.run_weights_independent_tranformations(factory.create_predict_module())
    )
    assert [a.ok for a in module.answer(GOOD)] == [True] * 3
    assert json.loads(factory.batching_metadata_json()) == {
        "float_features": {"type": "dense", "device": "cpu", "pinned": []},
        "id_list_features": {"type": "sparse", "device": "cpu", "pinned": ["lengths"]},
    }
    assert factory.qualname_metadata_json() == "{}"
    with pytest.raises(TypeError, match="abstract"):
        PredictFactory()
