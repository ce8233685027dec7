"""Train pipelines give the plain loop's weights, use every batch exactly once, and end cleanly.

The model is the DLRM of tests/model_parallel under DistributedModelParallel on 2 ranks, tables
sharded table-wise, row-wise, column-wise and data-parallel. Each pipeline trains over a counting
iterator; the plain loop (zero_grad, forward, backward, step) on the same batches is the reference.
"""

from __future__ import annotations

import copy
from typing import Iterator, List

import pytest
import torch
from torch import nn

from shardkit.model_parallel import CombinedOptimizer, DistributedModelParallel
from shardkit.pipeline import (
    PrefetchTrainPipelineSparseDist,
    TrainPipelineBase,
    TrainPipelineSparseDist,
)
from shardkit.pipeline.tracing import find_pipelineable_modules
from shardkit.sharding.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from shardkit.sharding.types import ShardingPlan
from shardkit.testing import run_world
from tests.model_parallel import _dlrm as d

NUM_BATCHES = 5
TOL = dict(rtol=1e-5, atol=1e-6)


class CountingIterator:
    """Yields this rank's batches ``0 .. n-1``; records every draw and every event of the step."""

    def __init__(self, rank: int, n: int, events: List[str]) -> None:
        self._rank, self._n, self._next, self._events = rank, n, 0, events
        self.draws = 0
        self.stops = 0

    def __iter__(self) -> Iterator[d.Batch]:
        return self

    def __next__(self) -> d.Batch:
        if self._next >= self._n:
            self.stops += 1
            raise StopIteration
        batch = d.rank_batch(self._next, self._rank)
        batch.dense_features[:, 0] = float(self._next)  # the batch's id, seen by the forward hook
        self._events.append(f"load {self._next}")
        self._next += 1
        self.draws += 1
        return batch


def _plan(model: d.DLRM, world_size: int) -> ShardingPlan:
    kinds = [table_wise(rank=1), row_wise(), column_wise(ranks=[0, 1]), data_parallel(), table_wise(rank=0)]
    generators = {name: kinds[i % len(kinds)] for i, (name, *_) in enumerate(d.TABLES)}
    return ShardingPlan(
        {"ebc": construct_module_sharding_plan(model.ebc, generators, world_size, world_size)}
    )


def _dmp(reference: d.DLRM, world_size: int):
    dmp = DistributedModelParallel(copy.deepcopy(reference), plan=_plan(reference, world_size))
    dense = torch.optim.SGD(dict(dmp.bare_named_parameters()).values(), lr=d.LR)
    return dmp, CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)])


def _instrument(dmp: DistributedModelParallel, events: List[str]) -> List[int]:
    """Log each forward (with the id of its batch) and each input dist start of the sharded EBC."""
    seen: List[int] = []
    ebc = dmp.module.ebc
    original = ebc.input_dist

    def input_dist(ctx, features):
        events.append("input_dist")
        return original(ctx, features)

    ebc.input_dist = input_dist

    def hook(module: nn.Module, args) -> None:
        batch_id = int(args[0].dense_features[0, 0])
        seen.append(batch_id)
        events.append(f"forward {batch_id}")

    dmp.module.register_forward_pre_hook(hook)
    return seen


def _assert_same_sharded_weights(model: nn.Module, reference: nn.Module) -> None:
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, expected[name], **TOL, msg=name)
    expected_shards = reference.ebc.local_shards()
    shards = model.ebc.local_shards()
    assert shards.keys() == expected_shards.keys()
    for key, weight in shards.items():
        torch.testing.assert_close(weight, expected_shards[key], **TOL, msg=str(key))


def _plain_loop(dmp, optimizer, rank: int) -> List[torch.Tensor]:
    outputs = []
    for batch in CountingIterator(rank, NUM_BATCHES, []):
        optimizer.zero_grad()
        loss, out = dmp(batch)
        loss.backward()
        optimizer.step()
        outputs.append(out)
    return outputs


def _drain(pipeline, data) -> list:
    """The outputs of ``progress`` until StopIteration."""
    outputs = []
    while True:
        try:
            outputs.append(pipeline.progress(data))
        except StopIteration:
            return outputs


def _run(pipeline_type, rank: int, world_size: int, reference_outputs, reference_model, new_epoch: bool):
    events: List[str] = []
    dmp, optimizer = _dmp(d.make_model(), world_size)
    seen = _instrument(dmp, events)
    pipeline = pipeline_type(dmp, optimizer, torch.device("cpu"))
    data = CountingIterator(rank, NUM_BATCHES, events)
    outputs = _drain(pipeline, data)
    with pytest.raises(StopIteration):
        pipeline.progress(data)
    # every batch once, in order; the data was drawn to its end and no further
    assert seen == list(range(NUM_BATCHES)) and data.draws == NUM_BATCHES
    for out, expected in zip(outputs, reference_outputs, strict=True):
        torch.testing.assert_close(out, expected, **TOL)
    _assert_same_sharded_weights(dmp.module, reference_model)
    if new_epoch:  # a new iterator is a new epoch: the pipeline starts over
        trained = _drain(pipeline, CountingIterator(rank, 2, []))
        assert len(trained) == 2 and seen == [*range(NUM_BATCHES), 0, 1]
    return pipeline, dmp, events


def _pipelines_worker() -> bool:
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    reference, reference_optimizer = _dmp(d.make_model(), world_size)
    reference_outputs = _plain_loop(reference, reference_optimizer, rank)
    reference_model = reference.module

    _run(TrainPipelineBase, rank, world_size, reference_outputs, reference_model, True)

    pipeline, dmp, events = _run(
        TrainPipelineSparseDist, rank, world_size, reference_outputs, reference_model, False
    )
    assert pipeline.pipelined_modules == ["ebc"]
    # batch i+1's input dist starts before batch i's forward
    for i in range(NUM_BATCHES - 1):
        assert events.index(f"load {i + 1}") < events.index(f"forward {i}")
        starts_before = events[: events.index(f"forward {i}")].count("input_dist")
        assert starts_before == i + 2
    # detached, the model runs on its own again and matches the plain loop's model
    model = pipeline.detach()
    batch = d.rank_batch(11, rank)
    with torch.no_grad():
        torch.testing.assert_close(model(batch)[1], reference(batch)[1], **TOL)

    pipeline, _, events = _run(
        PrefetchTrainPipelineSparseDist, rank, world_size, reference_outputs, reference_model, True
    )
    # two batches ahead: batch i+2 is loaded and its input dist started before batch i's forward
    for i in range(NUM_BATCHES - 2):
        assert events.index(f"load {i + 2}") < events.index(f"forward {i}")
        assert events[: events.index(f"forward {i}")].count("input_dist") == i + 3
    return True


def test_pipelines_match_the_plain_loop_and_use_every_batch_once():
    assert all(run_world(_pipelines_worker, 2))


def _early_stop_worker() -> List[int]:
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    events: List[str] = []
    dmp, optimizer = _dmp(d.make_model(), world_size)
    seen = _instrument(dmp, events)
    pipeline = PrefetchTrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"), execute_all_batches=False)
    data = CountingIterator(rank, NUM_BATCHES, events)
    with pytest.raises(StopIteration):
        while True:
            pipeline.progress(data)
    with pytest.raises(StopIteration):
        pipeline.progress(data)
    assert data.stops == 1  # the ended iterator is not asked again
    return seen


def test_execute_all_batches_false_stops_when_the_data_ends():
    # the batch still in flight when the data ends is dropped, the same on every rank
    assert run_world(_early_stop_worker, 2) == [list(range(NUM_BATCHES - 1))] * 2


class _TwoCalls(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, batch):
        first = self.ebc(batch.sparse_features).values()
        return first + self.ebc(batch.sparse_features).values()


def _tracing_worker() -> bool:
    dmp = DistributedModelParallel(d.make_model(), plan=_plan(d.make_model(), 2))
    [(name, module, args)] = find_pipelineable_modules(dmp.module)
    assert name == "ebc" and module is dmp.module.ebc
    assert [(a.input_attrs, a.is_getitems, a.name) for a in args] == [(["sparse_features"], [False], None)]
    # a module called twice per forward is not pipelined (one input dist per batch)
    assert find_pipelineable_modules(_TwoCalls(dmp.module.ebc)) == []
    with pytest.raises(ValueError, match="apply_jit"):
        TrainPipelineSparseDist(dmp, None, torch.device("cpu"), apply_jit=True)
    pipeline = TrainPipelineSparseDist(dmp, None, torch.device("cpu"))
    rank = torch.distributed.get_rank()
    with pytest.raises(RuntimeError, match="no input dist"):
        dmp(d.rank_batch(0, rank))
    # in eval mode progress only runs the forward (the optimizer is never touched)
    dmp.eval()
    batches = [d.rank_batch(step, rank) for step in range(3)]
    before = {n: p.detach().clone() for n, p in dmp.named_parameters()}
    outputs = []
    with torch.no_grad():
        data = iter(batches)
        while True:
            try:
                outputs.append(pipeline.progress(data))
            except StopIteration:
                break
        pipeline.detach()
        assert all(torch.equal(p, before[n]) for n, p in dmp.named_parameters())
        for batch, output in zip(batches, outputs, strict=True):
            torch.testing.assert_close(output, dmp(batch)[1])
    return True


def test_tracing_finds_the_batch_fed_modules_only():
    assert all(run_world(_tracing_worker, 2))


def _uneven_data_worker() -> str:
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    messages = []
    for pipeline_type in (TrainPipelineBase, TrainPipelineSparseDist, PrefetchTrainPipelineSparseDist):
        dmp, optimizer = _dmp(d.make_model(), world_size)
        pipeline = pipeline_type(dmp, optimizer, torch.device("cpu"))
        data = CountingIterator(rank, NUM_BATCHES - rank, [])  # rank 1 has one batch fewer
        with pytest.raises(ValueError) as info:
            _drain(pipeline, data)
        messages.append(str(info.value))
    return "\n".join(messages)


def test_data_ending_on_some_ranks_only_is_an_error_on_every_rank():
    for message in run_world(_uneven_data_worker, 2, timeout=120):
        assert message.count("the data ended on ranks [1] while the other ranks drew another batch") == 3
