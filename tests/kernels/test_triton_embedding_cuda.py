"""On a CUDA device: the compiled Triton kernels against the pure-torch reference, and a world-1
sharded EmbeddingBagCollection on CUDA against the unsharded one on CPU.

Marked ``cuda`` and skipped without a device; tools/device_check.sh runs them on a GPU machine.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.kernels import _triton_cases as cases

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (tools/device_check.sh runs these)"
    ),
]


def _assert_checks(checks):
    assert checks, "the case made no checks"
    failed = [f"{name}: {detail}" for name, passed, detail in checks if not passed]
    assert not failed, "\n".join(failed)


def test_triton_imports_compiled():
    from shardkit.kernels import triton_embedding

    assert triton_embedding.triton_failure() is None, triton_embedding.triton_failure()
    assert not triton_embedding.INTERPRETED, "TRITON_INTERPRET is set: the CUDA tests need compiled kernels"
    assert triton_embedding.available(torch.zeros(2, 2, device="cuda"))
    assert not triton_embedding.available(torch.zeros(2, 2))


@pytest.mark.parametrize("case", cases.ALL_CASES)
def test_triton_kernels_on_cuda(case):
    _assert_checks(cases.run_case(case, "cuda"))


@pytest.mark.parametrize("kind", cases.OPTIMIZER_KINDS)
def test_larger_batch_through_the_dispatch(kind):
    """100k x 128 table, 4096 bags of ~32 ids (skewed): the automatic choice on CUDA is Triton."""
    from shardkit.kernels import (
        RowOptimizerArgs,
        embedding_forward,
        embedding_fused_backward,
        embedding_torch,
        select_backend,
    )

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, dim, bags = 100_000, 128, 4096
    weight = torch.randn(rows, dim, device="cuda", generator=gen)
    lengths = torch.randint(16, 48, (bags,), device="cuda", generator=gen)
    offsets = torch.zeros(bags + 1, dtype=torch.int64, device="cuda")
    offsets[1:] = lengths.cumsum(0)
    n = int(offsets[-1])
    # squaring a uniform draw skews ids towards low rows: some rows are read hundreds of times
    ids = (torch.rand(n, device="cuda", generator=gen).square() * rows).to(torch.int64)
    scale = 1.0 / lengths.to(torch.float32)
    assert select_backend(weight, ids) == "triton"
    got = embedding_forward(weight, ids, offsets, bag_scale=scale)
    want = embedding_torch.embedding_forward(weight, ids, offsets, None, None, scale, True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    grad = torch.randn(bags, dim, device="cuda", generator=gen)
    shapes = {"SGD": [], "ADAGRAD": [(rows, dim)], "ROWWISE_ADAGRAD": [(rows,)], "ADAM": [(rows, dim)] * 2}
    state = [torch.rand(s, device="cuda", generator=gen) for s in shapes[kind]]
    initial_state = [s.clone() for s in state]
    mine, ref = weight.clone(), weight.clone()
    opt_mine = RowOptimizerArgs(kind, lr=0.05, eps=1e-3, step=2, state=tuple(state))
    opt_ref = RowOptimizerArgs(kind, lr=0.05, eps=1e-3, step=2, state=tuple(s.clone() for s in state))
    embedding_fused_backward(mine, ids, offsets, None, None, scale, grad, True, opt_mine)
    embedding_torch.embedding_fused_backward(ref, ids, offsets, None, None, scale, grad, True, opt_ref, False)
    assert not torch.equal(ref, weight)
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(opt_mine.state, opt_ref.state):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # deterministic: the same step again from the same start gives the same bits
    again = weight.clone()
    state2 = tuple(s.clone() for s in initial_state)
    opt_again = RowOptimizerArgs(kind, lr=0.05, eps=1e-3, step=2, state=state2)
    embedding_fused_backward(again, ids, offsets, None, None, scale, grad, True, opt_again)
    assert torch.equal(again, mine)


def _world1_sharded_ebc(optimizer_name: str, device_type: str = "cuda") -> bool:
    from shardkit.distributed.sharding_env import ShardingEnv
    from shardkit.modules import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        FusedOptimizerConfig,
        OptimType,
        PoolingType,
    )
    from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
    from shardkit.sharding.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from tests.sharding import _sharded_case as case

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(0)
    optimizer = OptimType[optimizer_name]
    tables = [
        EmbeddingBagConfig(50, 16, name="t_tw", feature_names=["f_tw"], pooling=PoolingType.SUM),
        EmbeddingBagConfig(40, 8, name="t_rw", feature_names=["f_rw1", "f_rw2"], pooling=PoolingType.MEAN),
    ]
    torch.manual_seed(0)
    reference = EmbeddingBagCollection(tables, fused_optimizer=FusedOptimizerConfig(optimizer, lr=0.1))
    plan = construct_module_sharding_plan(
        reference, {"t_tw": table_wise(rank=0), "t_rw": row_wise()}, 1, 1, device_type=device_type
    )
    sharded = EmbeddingBagCollectionSharder().shard(
        copy.deepcopy(reference), plan, ShardingEnv.from_process_group(None), device=device
    )
    features = [("f_tw", 50), ("f_rw1", 40), ("f_rw2", 40)]
    for step in range(3):
        kjt = case.to_kjt(case.batch_rows(step, 5, features))  # rank 5's recipe: 7 samples
        expected = reference(kjt)
        grad = torch.randn(expected.values().shape, generator=torch.Generator().manual_seed(step))
        (expected.values() * grad).sum().backward()
        out = sharded(kjt.to(device))
        assert out.keys() == expected.keys()
        assert out.values().device.type == device_type
        torch.testing.assert_close(out.values().cpu(), expected.values().detach(), rtol=1e-5, atol=1e-5)
        (out.values() * grad.to(device)).sum().backward()
    shards = sharded.local_shards()
    assert shards
    for (name, r0, r1, c0, c1), weight in shards.items():
        assert weight.device.type == device_type, name
        want = reference.table_weight(name)[r0:r1, c0:c1].detach()
        torch.testing.assert_close(weight.cpu(), want, rtol=1e-5, atol=1e-5)
    return True


@pytest.mark.parametrize("optimizer_name", ["SGD", "ADAGRAD"])
def test_world1_sharded_ebc_on_cuda(run_world, optimizer_name):
    assert run_world(_world1_sharded_ebc, 1, optimizer_name, backend="nccl") == [True]
