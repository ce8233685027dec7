"""The kept receive / output buffers of the comm ops (``comm_ops.scratch``): handed out again only when
nothing holds them, never while a step's output, a view, autograd or ``.grad`` does; the results of
the ops and of sharded modules over several steps stay those of fresh buffers."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed.comm_ops import alltoall_pooled, reduce_scatter_base_pooled, scratch
from shardkit.distributed.state import reset_all
from shardkit.testing import run_world

BIG = scratch.MIN_BYTES // 4  # fp32 elements of a buffer at the threshold


def _in_pool(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lies in one of the pool's kept buffers."""
    return tensor.untyped_storage()._cdata in {kept.storage._cdata for kept in scratch._kept}


def _settle(*holding: torch.Tensor, timeout_s: float = 10.0) -> bool:
    """Wait until no kept buffer is in use but those under ``holding`` (True), or ``timeout_s`` (False).

    Why: gloo's worker thread drops its reference to a finished collective's tensors a moment after
    ``wait()`` returns (on a busy machine, milliseconds later), and until then the pool rightly
    refuses those buffers. Tests that count buffers wait for that moment to pass; a buffer that
    something really keeps stays in use, and the counts that follow show it.
    """
    mine = {t.untyped_storage()._cdata for t in holding}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(kept.free() or kept.storage._cdata in mine for kept in scratch._kept):
            return True
        time.sleep(0.001)
    return False


@pytest.fixture(autouse=True)
def _fresh_pool():
    scratch.clear()
    yield
    reset_all()


def test_a_free_buffer_is_handed_out_again():
    first = scratch.empty((BIG,), torch.float32, None)
    ptr = first.data_ptr()
    del first
    again = scratch.empty((BIG // 2, 2), torch.float32, "cpu")  # same bytes, another shape
    assert again.data_ptr() == ptr and again.shape == (BIG // 2, 2) and again.is_contiguous()
    del again
    # bytes are bytes: another dtype of the same size class gets it too
    assert scratch.take(scratch.MIN_BYTES, "cpu").data_ptr() == ptr


def _held_ways():
    """Ways a caller keeps a buffer ``t`` (filled with 7): ``way(t)`` -> (what it keeps, a function
    reading the buffer's values back through it)."""
    weight = torch.ones(BIG, requires_grad=True)

    def saved(t):
        product = weight * t  # autograd saves t for weight's gradient
        return product, lambda: product.grad_fn._saved_other

    def storage(t):
        kept = t.untyped_storage()
        return kept, lambda: torch.empty(0).set_(kept, 0, (BIG,))

    def numpy(t):
        kept = t.numpy()
        return kept, lambda: torch.from_numpy(kept)

    return {
        "the tensor": lambda t: (t, lambda: t),
        "a view": lambda t: (t[BIG // 2 :], lambda: None),
        "a detached alias": lambda t: (t.detach(), lambda: None),
        "saved by autograd": saved,
        "its numpy array": numpy,
        "its storage object": storage,
    }


@pytest.mark.parametrize("way", list(_held_ways()))
def test_a_held_buffer_is_never_handed_out(way):
    buffer = scratch.empty((BIG,), torch.float32, None).fill_(7)
    ptr = buffer.data_ptr()
    kept, read = _held_ways()[way](buffer)
    view = kept if isinstance(kept, torch.Tensor) and read() is None else None
    del buffer
    others = []
    for _ in range(3):  # later requests of that size: new buffers, the held one untouched
        others.append(scratch.empty((BIG,), torch.float32, None).fill_(-1))
        assert others[-1].data_ptr() != ptr
        others.pop()  # dropped: the next request may take it, never the held one
    values = view if view is not None else read()
    assert bool((values == 7).all())
    del kept, read, view, values
    assert scratch.empty((BIG,), torch.float32, None).data_ptr() == ptr  # free now: the oldest free


class _GradFromPool(torch.autograd.Function):
    """Identity whose backward returns a pool buffer of 7s (as a comm op's backward returns its
    receive buffer): nothing else holds it, so AccumulateGrad makes it the leaf's ``.grad``."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return scratch.empty(tuple(grad.shape), grad.dtype, grad.device).fill_(7)


def test_a_gradient_stolen_into_grad_is_not_handed_out():
    leaf = torch.zeros(BIG, requires_grad=True)
    _GradFromPool.apply(leaf).sum().backward()
    ptr = leaf.grad.data_ptr()
    assert scratch.kept_bytes() == scratch.MIN_BYTES  # the gradient came from the pool
    assert scratch.empty((BIG,), torch.float32, None).fill_(-1).data_ptr() != ptr
    assert bool((leaf.grad == 7).all())
    leaf.grad = None  # zero_grad(set_to_none=True): free again
    assert scratch.empty((BIG,), torch.float32, None).data_ptr() == ptr


def test_small_and_non_cpu_requests_are_not_kept():
    small = scratch.empty((BIG - 1,), torch.float32, None)
    meta = scratch.empty((BIG,), torch.float32, "meta")
    assert scratch.kept_bytes() == 0 and small.numel() == BIG - 1 and meta.device.type == "meta"
    ptr = small.data_ptr()
    del small
    assert scratch.kept_bytes() == 0
    assert scratch.empty((0,), torch.float32, None).numel() == 0  # an empty request
    del ptr


def test_fake_tensors_are_not_kept():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # as torch.export traces: no real memory to keep
        fake = scratch.empty((BIG,), torch.float32, None)
    assert scratch.kept_bytes() == 0 and fake.shape == (BIG,)
    real = scratch.empty((BIG,), torch.float32, None).fill_(3)  # real memory, writable
    assert scratch.kept_bytes() == scratch.MIN_BYTES and float(real.sum()) == 3 * BIG


def test_at_most_max_kept_buffers_are_kept():
    held = [scratch.take(scratch.MIN_BYTES + n * scratch.GRANULE, "cpu") for n in range(scratch.MAX_KEPT + 3)]
    assert scratch.kept_bytes() == sum(t.numel() for t in held[3:])
    scratch.clear()
    assert scratch.kept_bytes() == 0


def test_kept_buffers_hold_at_most_max_kept_bytes(monkeypatch):
    monkeypatch.setattr(scratch, "MAX_KEPT_BYTES", 3 * scratch.MIN_BYTES)
    held = [scratch.take(scratch.MIN_BYTES, "cpu") for _ in range(4)]
    assert scratch.kept_bytes() == 3 * scratch.MIN_BYTES  # the oldest forgotten, still the caller's
    assert len({t.data_ptr() for t in held}) == 4
    big = scratch.take(4 * scratch.MIN_BYTES, "cpu")  # larger than the bound: kept alone
    assert scratch.kept_bytes() == big.numel()


def test_the_switch_turns_reuse_off(monkeypatch):
    scratch.set_recv_buffers(False)
    assert not scratch.recv_buffers_enabled()
    ptr = scratch.take(4 * scratch.MIN_BYTES, "cpu").data_ptr()
    assert scratch.kept_bytes() == 0
    # a fresh buffer of that size comes from its own mapping: at most by chance the same address,
    # but never kept
    scratch.take(4 * scratch.MIN_BYTES, "cpu")
    assert scratch.kept_bytes() == 0
    del ptr
    monkeypatch.setenv(scratch.ENV_VAR, "0")
    reset_all()  # the environment's default, as at import
    assert not scratch.recv_buffers_enabled()
    monkeypatch.setenv(scratch.ENV_VAR, "1")
    reset_all()
    assert scratch.recv_buffers_enabled()
    with pytest.raises(TypeError):
        scratch.set_recv_buffers(0)


def test_a_torch_without_the_use_count_gets_plain_buffers(monkeypatch):
    monkeypatch.setattr(scratch, "_SUPPORTED", False)
    monkeypatch.delenv(scratch.ENV_VAR, raising=False)
    reset_all()  # the default: off, since "free" cannot be proven
    assert not scratch.recv_buffers_enabled()
    scratch.take(4 * scratch.MIN_BYTES, "cpu")
    assert scratch.kept_bytes() == 0
    with pytest.raises(RuntimeError, match="_storage_Use_Count"):
        scratch.set_recv_buffers(True)
    monkeypatch.setattr(scratch, "_SUPPORTED", True)
    reset_all()
    assert scratch.recv_buffers_enabled()


# --------------------------------------------------------------------------------------------------
# the comm ops on several ranks


def _ops_reuse_free_buffers_and_keep_held_ones():
    world, rank = dist.get_world_size(), dist.get_rank()
    batch, dims = [64] * world, [4096 + 64 * r for r in range(world)]  # >= 1 MiB received

    def data(seed: int, r: int) -> torch.Tensor:
        return torch.randn(sum(batch), dims[r], generator=torch.Generator().manual_seed(seed * 10 + r))

    def expected(seed: int) -> torch.Tensor:
        return torch.cat([data(seed, r)[rank * 64 : rank * 64 + 64] for r in range(world)], dim=1)

    held = alltoall_pooled(data(1, rank), batch, dims).wait()
    ok = [_settle(held)]
    second = alltoall_pooled(data(2, rank), batch, dims).wait()  # the first is held: its own buffer
    ok += [torch.equal(held, expected(1)), torch.equal(second, expected(2))]
    kept = scratch.kept_bytes()  # the first's and the second's receive buffers and outputs
    del second
    ok.append(_settle(held))
    third = alltoall_pooled(data(3, rank), batch, dims).wait()  # the second was dropped: its buffers
    reused = scratch.kept_bytes() == kept and _in_pool(third)
    ok += [torch.equal(third, expected(3)), torch.equal(held, expected(1))]

    # reduce-scatter: the receive buffer and the sum both reused once dropped
    rows, cols = 4 * world, 65_536

    def rs_data(seed: int, r: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed * 10 + r))

    def rs_expected(seed: int) -> torch.Tensor:
        return torch.stack([rs_data(seed, r) for r in range(world)]).sum(dim=0)[rank * 4 : rank * 4 + 4]

    first_sum = reduce_scatter_base_pooled(rs_data(1, rank)).wait()
    sum_ptr = first_sum.data_ptr()
    ok.append(torch.equal(first_sum, rs_expected(1)))
    del first_sum
    ok.append(_settle(held, third))
    second_sum = reduce_scatter_base_pooled(rs_data(2, rank)).wait()
    reused_sum = second_sum.data_ptr() == sum_ptr
    ok.append(torch.equal(second_sum, rs_expected(2)))
    # empty inputs: nothing to receive, nothing kept for them
    empty = alltoall_pooled(torch.empty(0, dims[rank]), [0] * world, dims).wait()
    ok.append(empty.shape == (0, sum(dims)))
    return reused, reused_sum, ok


def test_ops_reuse_free_buffers_and_keep_held_ones():
    for reused, reused_sum, ok in run_world(_ops_reuse_free_buffers_and_keep_held_ones, 2):
        assert reused
        assert reused_sum
        assert all(ok), ok


def _placed_backward_reuses_its_buffers():
    from shardkit.distributed.comm_ops.placement import ColumnPlacement
    from shardkit.distributed.comm_ops.pooled_alltoall import alltoall_pooled_placed

    world, rank = dist.get_world_size(), dist.get_rank()
    width, blocks = 64, 4 * world  # rank r computes blocks r, r + W, ...: interleaved in the output
    placement = ColumnPlacement(width, [list(range(r, blocks, world)) for r in range(world)])
    batch = [1024] * world  # each rank's gradient [1024, blocks * width] fp32: 2 MiB with 2 ranks
    results, kept, settled = [], [], []
    for seed in (1, 2, 3):
        gen = torch.Generator().manual_seed(seed * 10 + rank)
        x = torch.randn(sum(batch), placement.columns(rank), generator=gen, requires_grad=True)
        out = alltoall_pooled_placed(x, batch, placement).wait()
        settled.append(_settle(out))  # the forward's receive buffer, copied into out, free again
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
        (out * weight).sum().backward()
        # x's rows of rank s got rank s's gradient of x's blocks (weight is the same on every rank),
        # divided by the world size (gradient division is on by default)
        mine = torch.cat([weight[:, b * width : (b + 1) * width] for b in placement.dest[rank]], dim=1)
        results.append(
            torch.equal(x.grad, mine.repeat(world, 1) / world) and _in_pool(out) and _in_pool(x.grad)
        )
        del out, x  # the output and the input gradient (the backward's receive buffer) dropped
        settled.append(_settle())
        kept.append(scratch.kept_bytes())
    return kept, results, settled


def test_placed_forward_and_backward_reuse_their_buffers():
    for kept, exact, settled in run_world(_placed_backward_reuses_its_buffers, 2):
        # the first step's buffers (the forward's receive buffer and output, the backward's send
        # and receive buffers, 2 MiB each, some shared) serve the later steps: nothing new
        assert 0 < kept[0] <= 4 * (2 << 20) and kept[1] == kept[0] and kept[2] == kept[0]
        assert exact == [True, True, True] and settled == [True] * 6


# --------------------------------------------------------------------------------------------------
# a sharded module over several steps, each step's output held through the next one


TABLES = [  # (name, rows, dim, sharding): outputs and exchanges of >= 1 MiB at 512 samples per rank
    ("t_tw0", 40, 256, "table_wise"),
    ("t_tw1", 30, 128, "table_wise"),
    ("t_cw", 50, 512, "column_wise"),
    ("t_rw", 60, 512, "row_wise"),
]
SAMPLES = 512


def _module():
    from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, OptimType

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(rows, dim, name=name, feature_names=[f"f_{name}"]) for name, rows, dim, _ in TABLES
    ]
    return EmbeddingBagCollection(tables, fused_optimizer=FusedOptimizerConfig(OptimType.SGD, lr=0.1))


def _batch(step: int, rank: int):
    from shardkit.sparse import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(1000 * step + rank)
    keys = [f"f_{name}" for name, *_ in TABLES]
    lengths = torch.randint(0, 4, (len(TABLES) * SAMPLES,), generator=gen)
    rows = torch.tensor([rows for _, rows, *_ in TABLES]).repeat_interleave(SAMPLES)
    values = torch.cat([torch.randint(0, int(r), (int(n),), generator=gen) for r, n in zip(rows, lengths)])
    return KeyedJaggedTensor(keys, values, lengths=lengths)


def _global_batch(step: int, world: int):
    from shardkit.sparse import KeyedJaggedTensor

    parts = [_batch(step, r).to_dict() for r in range(world)]
    keys = [f"f_{name}" for name, *_ in TABLES]
    lengths = torch.cat([torch.cat([parts[r][k].lengths() for r in range(world)]) for k in keys])
    values = torch.cat([torch.cat([parts[r][k].values() for r in range(world)]) for k in keys])
    return KeyedJaggedTensor(keys, values, lengths=lengths)


def _sharded_steps_stay_exact(steps: int):
    from shardkit.distributed.sharding_env import ShardingEnv
    from shardkit.sharding import sharding_plan as sp
    from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder

    rank, world = dist.get_rank(), dist.get_world_size()
    scratch.clear()
    reference = _module()
    generators = {
        "t_tw0": sp.table_wise(rank=0),
        "t_tw1": sp.table_wise(rank=world - 1),
        "t_cw": sp.column_wise(ranks=[0, world - 1]),
        "t_rw": sp.row_wise(),
    }
    plan = sp.construct_module_sharding_plan(reference, generators, world, world)
    sharded = EmbeddingBagCollectionSharder().shard(
        copy.deepcopy(reference), plan, ShardingEnv.from_process_group(None)
    )
    mine = slice(rank * SAMPLES, (rank + 1) * SAMPLES)
    held, held_values, errors, counts = None, None, [], []
    for step in range(steps):
        expected = reference(_global_batch(step, world))
        grad = torch.randn(expected.values().shape, generator=torch.Generator().manual_seed(step))
        (expected.values() * grad).sum().div(world).backward()
        out = sharded(_batch(step, rank))
        errors.append((out.values() - expected.values()[mine]).abs().max().item())
        (out.values() * grad[mine]).sum().backward()
        if held is not None:  # the previous step's output, held through this step: unchanged
            errors.append(0.0 if torch.equal(held.values(), held_values) else float("inf"))
        held, held_values = out, out.values().detach().clone()
        del out, expected
        counts.append(scratch.counts())
    return max(errors), counts


def test_sharded_module_steps_stay_exact_with_reused_buffers():
    for error, counts in run_world(_sharded_steps_stay_exact, 2, 4):
        # the first step's buffers serve the later steps (the first two steps: one step's output is
        # held through the next), and they were used: outputs and exchanges of >= 1 MiB
        assert counts[0]["new"] > 0 and counts[-1]["new"] == counts[1]["new"], counts
        assert counts[-1]["reused"] >= 2 * counts[0]["new"], counts
        assert error <= 1e-5


def _kjt_exchange_reuses_its_receive_buffers():
    from shardkit.sharding.dist_data import KJTAllToAll
    from shardkit.sparse import KeyedJaggedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    samples, ids = 4096, 64  # 2 keys x 4096 bags x 64 int64 ids: 4 MiB of ids per rank

    def kjt(step: int, r: int) -> KeyedJaggedTensor:
        gen = torch.Generator().manual_seed(100 * step + r)
        values = torch.randint(0, 1 << 40, (2 * samples * ids,), generator=gen)
        lengths = torch.full((2 * samples,), ids, dtype=torch.int64)
        return KeyedJaggedTensor(["a", "b"], values, lengths=lengths)

    def expected(step: int) -> torch.Tensor:  # rank r gets key r's bags of every rank, rank order
        return torch.cat([kjt(step, s).values().view(2, -1)[rank] for s in range(world)])

    held = KJTAllToAll(None, [1, 1])(kjt(0, rank)).wait().wait()
    ok = [torch.equal(held.values(), expected(0))]
    for step in (1, 2, 3):
        out = KJTAllToAll(None, [1, 1])(kjt(step, rank)).wait().wait()
        ok.append(torch.equal(out.values(), expected(step)) and _in_pool(out.values()))
        del out
        ok.append(_settle(held.values()))
        counts = scratch.counts()
    ok.append(torch.equal(held.values(), expected(0)))  # held through three more exchanges
    return ok, counts


def test_kjt_exchange_reuses_its_receive_buffers():
    for ok, counts in run_world(_kjt_exchange_reuses_its_receive_buffers, 2):
        assert all(ok), ok
        assert counts["reused"] >= 2, counts
