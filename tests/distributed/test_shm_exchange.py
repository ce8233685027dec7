"""The shared-memory all-to-all gives gloo's bytes exactly, through growth, uneven and empty splits, on
subgroups, 2-D tensors, and leaves no file behind; the sharded training step is bitwise the same."""

from __future__ import annotations

import glob

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed import shm_exchange
from shardkit.distributed.direct_collectives import all_to_all_single
from shardkit.distributed.switches import result_switches
from shardkit.testing import run_world


def _prefixes() -> list:
    """The file prefixes of this process's exchanges (the files of this test, whatever else runs)."""
    return [e.prefix for e in shm_exchange._EXCHANGES.values() if e is not None]


def _left_behind(prefixes: list) -> list:
    return [path for prefix in prefixes for path in glob.glob(prefix + "-*")]


def _both(send, recv_splits, send_splits, group, dtype):
    """(shared-memory result, gloo's result) of one exchange."""
    rows = sum(recv_splits)
    shape = (rows, *send.shape[1:])
    shm_exchange.set_shm_exchange(True)
    try:
        got = torch.empty(shape, dtype=dtype)
        work = all_to_all_single(got, send, recv_splits, send_splits, group, async_op=True)
        assert work.wait() and work.is_completed()
    finally:
        shm_exchange.set_shm_exchange(False)
    ref = torch.empty(shape, dtype=dtype)
    all_to_all_single(ref, send, recv_splits, send_splits, group, async_op=False)
    return got, ref


def _exchanges(seed: int) -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    # every rank draws the same split matrix: splits[s][d] rows from s to d (zeros included)
    mismatches = []
    groups = [dist.group.WORLD] + ([dist.new_group(list(range(1, world)))] if world > 2 else [])
    for size_scale in (1, 3000, 10, 200_000, 7):  # growth past the 1 MiB first file, then smaller
        for group in groups:
            members = list(range(world)) if group is dist.group.WORLD else list(range(1, world))
            w = len(members)
            splits = torch.randint(0, 4, (w, w), generator=gen) * size_scale  # drawn on every rank
            if rank not in members:
                continue
            me = members.index(rank)
            splits[0, 1] = 0  # a pair that sends nothing
            for dtype, cols in ((torch.float32, 1), (torch.int64, 3), (torch.uint8, 1)):
                send_splits, recv_splits = splits[me].tolist(), splits[:, me].tolist()
                shape = (sum(send_splits), cols) if cols > 1 else (sum(send_splits),)
                send = (torch.randn(shape) * 100).to(dtype) + rank
                got, ref = _both(send, recv_splits, send_splits, group, dtype)
                if not torch.equal(got.view(torch.uint8), ref.view(torch.uint8)):
                    mismatches.append((size_scale, dtype, me))
    prefixes = _prefixes()
    shm_exchange.close_all()
    dist.barrier()  # every rank closed: none of the test's files is left
    return mismatches + _left_behind(prefixes)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shared_memory_all_to_all_equals_gloo_bytes_and_leaves_no_file(world):
    assert run_world(_exchanges, world, 7) == [[]] * world


def _bad_env() -> str:
    shm_exchange._enabled = None
    try:
        shm_exchange.shm_exchange_enabled()
    except ValueError as err:
        return str(err)
    finally:
        shm_exchange._enabled = None
    return ""


def test_a_bad_setting_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv("SHARDKIT_SHM_EXCHANGE", "yes")
    message = _bad_env()
    assert "SHARDKIT_SHM_EXCHANGE='yes'" in message and "0 or 1" in message


def test_the_switch_is_one_the_ranks_must_agree_on():
    shm_exchange.set_shm_exchange(True)
    try:
        assert result_switches()["shared-memory exchange (set_shm_exchange / SHARDKIT_SHM_EXCHANGE)"]
    finally:
        shm_exchange.set_shm_exchange(False)


class _Wrapper(torch.nn.Module):
    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, features):
        return self.ebc(features)


def _sharded_steps(kind: str, enabled: bool) -> dict:
    from shardkit.distributed.sharding_env import ShardingEnv
    from shardkit.model_parallel import DistributedModelParallel
    from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
    from shardkit.sharding import sharding_plan as plans
    from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
    from shardkit.sharding.sharding_plan import construct_module_sharding_plan
    from shardkit.sharding.types import ShardingPlan
    from shardkit.sparse import KeyedJaggedTensor

    shm_exchange.set_shm_exchange(enabled)
    try:
        torch.manual_seed(0)
        rows = [300, 5000, 70, 20000]
        configs = [
            EmbeddingBagConfig(n, 16, name=f"t{i}", feature_names=[f"f{i}"]) for i, n in enumerate(rows)
        ]
        module = EmbeddingBagCollection(configs, fused_optimizer=FusedOptimizerConfig("ADAGRAD", lr=0.1))
        make = {
            "table_wise": lambda i: plans.table_wise(rank=i % 2),
            "row_wise": lambda i: plans.row_wise(),
            "column_wise": lambda i: plans.column_wise(ranks=[0, 1]),
        }[kind]
        plan = construct_module_sharding_plan(
            module, {f"t{i}": make(i) for i in range(4)}, world_size=2, local_size=2
        )
        model = DistributedModelParallel(
            _Wrapper(module),
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            device=torch.device("cpu"),
            plan=ShardingPlan({"ebc": plan}),
            sharders=[EmbeddingBagCollectionSharder()],
        )
        gen = torch.Generator().manual_seed(10 + dist.get_rank())
        outs = []
        for _ in range(3):
            lengths = torch.randint(0, 5, (4 * 64,), generator=gen)
            limit = torch.tensor(rows).repeat_interleave(64).repeat_interleave(lengths)
            values = (torch.rand(limit.numel(), generator=gen) * limit).long()
            kjt = KeyedJaggedTensor([f"f{i}" for i in range(4)], values, lengths=lengths)
            out = model(kjt)
            pooled = out.wait() if hasattr(out, "wait") else out
            pooled.values().pow(2).sum().backward()
            outs.append(pooled.values().detach().clone())
        state = {k: v for k, v in model.state_dict().items()}
        weights = []
        for key in sorted(state):
            value = state[key]
            if hasattr(value, "local_shards"):
                weights += [s.tensor.clone() for s in value.local_shards()]
            elif isinstance(value, torch.Tensor):
                weights.append(value.clone())
        calls = sum(e._calls for e in shm_exchange._EXCHANGES.values() if e is not None)
        return {"outs": outs, "weights": weights, "shm_calls": calls}
    finally:
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()


@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise"])
def test_a_sharded_training_step_is_bitwise_the_same_through_shared_memory(kind):
    on, off = run_world(_sharded_steps, 2, kind, True), run_world(_sharded_steps, 2, kind, False)
    for a, b in zip(on, off):
        # each of the 3 steps exchanges its input and its output through shared memory (table-wise and
        # column-wise their gradients too; row-wise's travel in an all-gather)
        assert a["shm_calls"] >= 2 * 3 and b["shm_calls"] == 0
        assert len(a["weights"]) == len(b["weights"]) > 0
        assert all(torch.equal(x, y) for x, y in zip(a["outs"], b["outs"]))
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))


def _all_reduce_fill(sizes) -> list:
    """Per size: whether the sum of terms made by ``fill`` in the shared buffer equals, bit for bit,
    the sum of the same terms passed in the tensor, and whether ``fill`` wrote elsewhere than the
    tensor (the peers read it where it was made)."""
    rank = dist.get_rank()
    shm_exchange.set_shm_exchange(True)
    try:
        exchange = shm_exchange.exchange_for(dist.group.WORLD)
        results = []
        for n in sizes:
            term = torch.randn(n, 3, generator=torch.Generator().manual_seed(rank * 100 + n)) * 1e3
            passed = term.clone()
            exchange.all_reduce_sum(passed).wait()
            made = torch.full_like(term, float("nan"))  # the sum overwrites every element
            outs = []

            def fill(out, term=term, outs=outs):
                outs.append(out.data_ptr())
                out.copy_(term)

            exchange.all_reduce_sum(made, fill).wait()
            results.append((torch.equal(made, passed), outs != [made.data_ptr()], len(outs)))
        return results
    finally:
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()


@pytest.mark.parametrize("world", [2, 3])
def test_an_all_reduce_term_can_be_made_in_the_shared_buffer(world):
    for got in run_world(_all_reduce_fill, world, [1, 5000, 40_000]):
        assert got == [(True, True, 1)] * 3
