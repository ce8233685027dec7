"""ShardedEmbeddingBag equals the unsharded nn.EmbeddingBag on the global batch.

One ``run_world`` per world size checks every sharding type: forward values, the gradient of
``per_sample_weights``, and the table after SGD steps (dense on the local shards, or the sharder's
fused optimizer), with both input forms (1-D ids + offsets, 2-D ids), modes sum and mean; then the
``weight`` state-dict round trip. Bad modules, plans and inputs must fail on every rank.
"""

from __future__ import annotations

import copy
from typing import List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardkit.sharding as sharding
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import OptimType
from shardkit.sharding import EmbeddingBagSharder, EmbeddingModuleShardingPlan, ShardedEmbeddingBag
from shardkit.sharding.sharding_plan import (
    column_wise,
    data_parallel,
    grid_shard,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

ROWS, DIM = 13, 5  # uneven row blocks and column blocks at 2 and 3 ranks
LR = 0.1
LENGTH = 3  # ids per bag of the 2-D input
TOL = dict(rtol=1e-5, atol=1e-6)
DENSE, FUSED = "dense", "fused"


def _generators(world_size: int, kernel: str):
    """One generator per sharding type (data-parallel: the DENSE kernel, which a generator called directly
    gives it; _check_type asks for ``kernel`` by name)."""
    return {
        "data_parallel": data_parallel(),
        "table_wise": table_wise(rank=world_size - 1, compute_kernel=kernel),
        "column_wise": column_wise(ranks=[0, world_size - 1, world_size - 1], compute_kernel=kernel),
        "row_wise": row_wise(compute_kernel=kernel),
        "table_row_wise": table_row_wise(host_index=0, compute_kernel=kernel),
        "table_column_wise": table_column_wise(host_index=0, compute_kernel=kernel),
        # one node: one column block, its rows over the node's ranks
        "grid_shard": grid_shard(host_indexes=[0], compute_kernel=kernel),
    }


def _plan(generator, world_size: int) -> EmbeddingModuleShardingPlan:
    sharding_ = generator("weight", (ROWS, DIM), world_size, world_size, "cpu")
    sharding_.check("weight", (ROWS, DIM), world_size)
    return EmbeddingModuleShardingPlan({"weight": sharding_})


def _bags(step: int, rank: int, form: str) -> List[List[int]]:
    """Rank ``rank``'s ``2 + rank`` bags at ``step`` (1-D form: 0 to 3 ids, some empty)."""
    gen = torch.Generator().manual_seed(7919 * step + 104729 * rank + len(form))
    lengths = (
        [LENGTH] * (2 + rank) if form == "2d" else torch.randint(0, 4, (2 + rank,), generator=gen).tolist()
    )
    return [torch.randint(0, ROWS, (n,), generator=gen).tolist() for n in lengths]


def _inputs(bags: List[List[int]], form: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(input, offsets) of ``bags`` in nn.EmbeddingBag's 1-D or 2-D form."""
    if form == "2d":
        return torch.tensor(bags, dtype=torch.int64), None
    offsets = torch.tensor([0] + [len(b) for b in bags[:-1]], dtype=torch.int64).cumsum(0)
    return torch.tensor([i for b in bags for i in b], dtype=torch.int64), offsets


def _local_part(tensor: torch.Tensor, form: str, per_rank: List[List[List[int]]], rank: int) -> torch.Tensor:
    """The entries of a global input-shaped ``tensor`` that belong to rank ``rank``'s bags."""
    if form == "2d":
        start = sum(len(bags) for bags in per_rank[:rank])
        return tensor[start : start + len(per_rank[rank])]
    start = sum(len(b) for bags in per_rank[:rank] for b in bags)
    return tensor[start : start + sum(len(b) for b in per_rank[rank])]


def _step_sgd_(sharded: ShardedEmbeddingBag, world_size: int) -> None:
    """Dense SGD: sharded shards step on their gradient (the output dists already summed it over
    ranks); a data-parallel replica averages its gradient first, as DDP would."""
    sharded_names = set(sharded.sharded_parameter_names())
    for name, param in sharded.named_parameters():
        if param.grad is None:
            continue
        if name not in sharded_names:
            dist.all_reduce(param.grad)
            param.grad.div_(world_size)
        with torch.no_grad():
            param.add_(param.grad, alpha=-LR)
        param.grad = None


def _check_type(sharding_type: str, mode: str, kernel: str, forms: List[str]) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    env = ShardingEnv.from_process_group(None)
    torch.manual_seed(0)
    reference = nn.EmbeddingBag(ROWS, DIM, mode=mode)
    generator = _generators(world_size, kernel)[sharding_type]
    if sharding_type == "data_parallel":  # FUSED too: its fused optimizer steps on the all-reduced gradient
        generator = data_parallel(compute_kernel=kernel)
    fused = kernel == FUSED
    sharder = EmbeddingBagSharder(
        fused_params={"optimizer": OptimType.SGD, "learning_rate": LR} if fused else None
    )
    sharded = sharder.shard(copy.deepcopy(reference), _plan(generator, world_size), env)
    assert isinstance(sharded, ShardedEmbeddingBag) and sharded.table_name == "weight"
    for step, form in enumerate(forms):
        per_rank = [_bags(step, r, form) for r in range(world_size)]
        mine = slice(sum(2 + r for r in range(rank)), sum(2 + r for r in range(rank + 1)))
        global_input, global_offsets = _inputs([b for bags in per_rank for b in bags], form)
        local_input, local_offsets = _inputs(per_rank[rank], form)
        weighted = mode == "sum" and step % 2 == 0
        global_weights = local_weights = None
        if weighted:
            global_weights = torch.rand(global_input.shape, generator=torch.Generator().manual_seed(step))
            global_weights.requires_grad_()
            local_weights = _local_part(global_weights, form, per_rank, rank).detach().clone()
            local_weights.requires_grad_()
        expected = reference(global_input, global_offsets, per_sample_weights=global_weights)
        grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(100 + step))
        # the comm ops divide gradients by the world size (DDP's mean): the reference loss is a mean
        (expected * grad).sum().div(world_size).backward()
        with torch.no_grad():
            reference.weight.add_(reference.weight.grad, alpha=-LR)
        reference.weight.grad = None
        out = sharded(local_input, local_offsets, local_weights)
        case = f"{sharding_type} {mode} {kernel} step {step} ({form})"
        torch.testing.assert_close(out.wait(), expected[mine].detach(), **TOL, msg=case)
        (out * grad[mine]).sum().backward()
        _step_sgd_(sharded, world_size)
        if weighted:
            expected_grad = _local_part(global_weights.grad, form, per_rank, rank)
            torch.testing.assert_close(local_weights.grad, expected_grad, **TOL)
    torch.testing.assert_close(sharded.full_table("weight"), reference.weight.detach(), **TOL)
    state = sharded.state_dict()
    assert list(state) == ["weight"]
    fresh = sharder.shard(nn.EmbeddingBag(ROWS, DIM, mode=mode), _plan(generator, world_size), env)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh.full_table("weight"), reference.weight.detach(), **TOL)


def _exactness_worker() -> bool:
    for sharding_type in _generators(1, DENSE):
        _check_type(sharding_type, "sum", DENSE, ["1d", "2d", "1d"])
        _check_type(sharding_type, "mean", FUSED, ["2d", "1d"])
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_sharding_type_matches_nn_embedding_bag(world_size):
    assert all(run_world(_exactness_worker, world_size))


def _bad_input_worker() -> bool:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    env = ShardingEnv.from_process_group(None)
    sharder = EmbeddingBagSharder()
    plan = _plan(row_wise(compute_kernel=DENSE), world_size)
    case.raises_value_error(lambda: sharder.shard(nn.EmbeddingBag(ROWS, DIM, mode="max"), plan, env), "'max'")
    # only rank 1's module is bad: every rank raises, naming it
    padded = nn.EmbeddingBag(ROWS, DIM, padding_idx=0 if rank == 1 else None)
    case.raises_value_error(lambda: sharder.shard(padded, plan, env), "rank 1", "padding_idx")
    two_tables = EmbeddingModuleShardingPlan({**plan, "other": plan["weight"]})
    case.raises_value_error(lambda: sharder.shard(nn.EmbeddingBag(ROWS, DIM), two_tables, env), "other")
    fused = _plan(row_wise(), world_size)  # a FUSED kernel without fused_params
    case.raises_value_error(lambda: sharder.shard(nn.EmbeddingBag(ROWS, DIM), fused, env), "fused")

    sharded = sharder.shard(nn.EmbeddingBag(ROWS, DIM), plan, env)
    ids = torch.tensor([[1, 2], [ROWS if rank == 0 else 3, 4]])
    case.raises_value_error(lambda: sharded(ids), "rank 0", "out of range")
    offsets = torch.tensor([0, 1]) if rank == 1 else None  # 2-D input with offsets on rank 1 only
    case.raises_value_error(lambda: sharded(torch.tensor([[1, 2]]), offsets), "rank 1", "offsets")
    decreasing = torch.tensor([0, 2, 1]) if rank == 0 else torch.tensor([0, 1, 2])
    case.raises_value_error(lambda: sharded(torch.tensor([1, 2, 3]), decreasing), "rank 0", "offsets")
    # the module still works after the failed forwards
    torch.testing.assert_close(sharded(ids.clamp(max=ROWS - 1)).wait().shape, torch.Size([2, DIM]))
    return True


def test_bad_modules_plans_and_inputs_fail_on_every_rank():
    assert all(run_world(_bad_input_worker, 2))


def _include_last_offset_worker() -> bool:
    """include_last_offset, table-wise and row-wise; a last offset short of the ids is an error."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = nn.EmbeddingBag(ROWS, DIM, include_last_offset=True)
    ids = torch.tensor([1, 2, 3, 4, 5]) + rank
    offsets = torch.tensor([0, 2, 2, 5])
    for generator in (table_wise(rank=1, compute_kernel=DENSE), row_wise(compute_kernel=DENSE)):
        sharded = EmbeddingBagSharder().shard(
            reference, _plan(generator, world_size), ShardingEnv.from_process_group(None)
        )
        torch.testing.assert_close(sharded(ids, offsets).wait(), reference(ids, offsets).detach(), **TOL)
    case.raises_value_error(lambda: sharded(torch.cat([ids, ids]), offsets), "offsets", "end at")
    return True


def test_include_last_offset():
    assert all(run_world(_include_last_offset_worker, 2))


def test_exports_and_sharder_surface():
    assert sharding.ShardedEmbeddingBag is ShardedEmbeddingBag
    bag = nn.EmbeddingBag(ROWS, DIM)
    plain, fused = (
        EmbeddingBagSharder(),
        EmbeddingBagSharder(fused_params={"optimizer": "ADAGRAD", "lr": 0.1}),
    )
    assert plain.module_type is nn.EmbeddingBag
    assert plain.shardable_parameters(bag) == {"weight": bag.weight}
    assert len(plain.sharding_types("cpu")) == 7
    assert plain.compute_kernels("row_wise", "cpu") == [DENSE]
    assert fused.compute_kernels("row_wise", "cpu") == [FUSED, DENSE]
    assert fused.compute_kernels("data_parallel", "cpu") == [FUSED, DENSE]
    assert plain.compute_kernels("data_parallel", "cpu") == [DENSE]
    with pytest.raises(ValueError, match="momentum"):
        EmbeddingBagSharder(fused_params={"optimizer": "SGD", "momentum": 0.9})
