"""Data-parallel tables use the dense or the fused kernel (exactness: the sharded-module tests)."""

from __future__ import annotations

import pytest

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.sharding.data_parallel import DpPooledEmbeddingSharding
from shardkit.sharding.embedding_sharding import sharded_table
from shardkit.sharding.replicated_fused_lookup import ReplicatedShardedLookup
from shardkit.sharding.sharding_plan import data_parallel
from shardkit.sharding.types import EmbeddingComputeKernel


def test_other_kernels_are_rejected():
    config = EmbeddingBagConfig(4, 2, name="d", feature_names=["f"])
    table = sharded_table(
        config, data_parallel(EmbeddingComputeKernel.FUSED_UVM.value)("d", (4, 2), 2, 2, "cpu"), 2
    )
    with pytest.raises(ValueError, match="'d'.*dense kernel.*fused one.*got 'fused_uvm'"):
        DpPooledEmbeddingSharding([table], ShardingEnv.from_local(2, 0), True)


def test_fused_kernel_replicas_carry_the_fused_optimizer():
    config = EmbeddingBagConfig(4, 2, name="d", feature_names=["f"])
    table = sharded_table(
        config, data_parallel(EmbeddingComputeKernel.FUSED.value)("d", (4, 2), 2, 2, "cpu"), 2
    )
    optimizer = FusedOptimizerConfig(OptimType.ADAM, lr=0.1)
    sharding = DpPooledEmbeddingSharding([table], ShardingEnv.from_local(2, 1), True, optimizer)
    lookup = sharding.create_lookup()
    assert isinstance(lookup, ReplicatedShardedLookup)
    assert list(lookup.local_shards()) == [("d", 0, 4, 0, 2)]
    assert lookup.lookups[0].optimizer.config == optimizer and lookup.lookups[0].world_size == 2


def test_dense_kernel_holds_the_whole_table():
    config = EmbeddingBagConfig(4, 2, name="d", feature_names=["f"])
    table = sharded_table(config, data_parallel()("d", (4, 2), 2, 2, "cpu"), 2)
    sharding = DpPooledEmbeddingSharding([table], ShardingEnv.from_local(2, 1), True)
    lookup = sharding.create_lookup()
    assert list(lookup.local_shards()) == [("d", 0, 4, 0, 2)]
    assert lookup.lookups[0].optimizer is None


def _replica_worker():
    """Each rank builds its collection with other weights: the FUSED data-parallel replicas start as
    rank 0's (no data-parallel wrapper broadcasts them), sharded directly and through DMP on meta."""
    import torch
    import torch.distributed as dist

    from shardkit.model_parallel import DistributedModelParallel
    from shardkit.modules import EmbeddingBagCollection
    from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
    from shardkit.sharding.sharding_plan import construct_module_sharding_plan

    rank = dist.get_rank()

    def ebc(device=None):
        torch.manual_seed(rank)
        config = EmbeddingBagConfig(6, 4, name="d", feature_names=["f"])
        return EmbeddingBagCollection(
            [config], device=device, fused_optimizer=FusedOptimizerConfig(OptimType.ADAGRAD, lr=0.1)
        )

    module = ebc()
    plan = construct_module_sharding_plan(module, {"d": data_parallel()})
    direct = EmbeddingBagCollectionSharder().shard(module, plan, ShardingEnv.from_process_group(None))
    weights = [direct.local_shards()[("d", 0, 6, 0, 4)].clone()]
    dmp = DistributedModelParallel(
        torch.nn.Sequential(ebc(torch.device("meta"))),
        device=torch.device("cpu"),
        sharders=[EmbeddingBagCollectionSharder()],
    )
    weights.append(dmp.module[0].local_shards()[("d", 0, 6, 0, 4)].clone())
    return weights


def test_fused_replicas_start_equal():
    from shardkit.testing import run_world

    (direct0, dmp0), (direct1, dmp1) = run_world(_replica_worker, 2)
    assert direct0.equal(direct1) and dmp0.equal(dmp1)


def _empty_bags_worker():
    """Rank 1's bags are all empty (no ids): it still takes part in the all-reduce, and both replicas
    take the unsharded module's step on the global batch."""
    import torch
    import torch.distributed as dist

    from shardkit.modules import EmbeddingBagCollection
    from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
    from shardkit.sharding.sharding_plan import construct_module_sharding_plan
    from shardkit.sparse import KeyedJaggedTensor

    rank = dist.get_rank()

    def ebc():
        torch.manual_seed(0)
        config = EmbeddingBagConfig(6, 4, name="d", feature_names=["f"])
        return EmbeddingBagCollection([config], fused_optimizer=FusedOptimizerConfig(OptimType.ADAM, lr=0.1))

    reference, module = ebc(), ebc()
    plan = construct_module_sharding_plan(module, {"d": data_parallel()})
    sharded = EmbeddingBagCollectionSharder().shard(module, plan, ShardingEnv.from_process_group(None))
    mine = [torch.tensor([1, 4, 4]), torch.tensor([], dtype=torch.int64)][rank]
    lengths = [torch.tensor([2, 1]), torch.tensor([0, 0])][rank]
    grad = torch.arange(16, dtype=torch.float32).view(4, 4)
    for _ in range(2):
        whole = KeyedJaggedTensor(["f"], torch.tensor([1, 4, 4]), lengths=torch.tensor([2, 1, 0, 0]))
        (reference(whole).values() * grad).sum().div(2).backward()
        out = sharded(KeyedJaggedTensor(["f"], mine, lengths=lengths)).values()
        (out * grad[2 * rank : 2 * rank + 2]).sum().backward()
    return sharded.local_shards()[("d", 0, 6, 0, 4)].clone(), reference.table_weight("d").detach().clone()


def test_a_rank_with_empty_bags_steps_the_fused_replica_too():
    import torch

    from shardkit.testing import run_world

    for got, want in run_world(_empty_bags_worker, 2):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_input_dist_reads_the_per_key_lengths_once_not_once_per_feature(monkeypatch):
    # with 256 data-parallel tables, reading length_per_key() (a fresh list of every key's length) once
    # per feature was 65k subtractions, ~8 ms of Python per forward (the vs_torchrec sweep's profile)
    import torch

    from shardkit.sharding.embedding_sharding import ShardingContext
    from shardkit.sparse import KeyedJaggedTensor

    features = 32
    tables = [
        sharded_table(
            EmbeddingBagConfig(4, 2, name=f"t{i}", feature_names=[f"f{i}"]),
            data_parallel()(f"t{i}", (4, 2), 2, 2, "cpu"),
            2,
        )
        for i in range(features)
    ]
    sharding = DpPooledEmbeddingSharding(tables, ShardingEnv.from_local(2, 0), True)
    lengths = torch.tensor([1, 2] * features)
    kjt = KeyedJaggedTensor(
        [f"f{i}" for i in range(features)], torch.zeros(3 * features, dtype=torch.long), lengths=lengths
    )
    calls = []
    original = KeyedJaggedTensor.length_per_key
    monkeypatch.setattr(KeyedJaggedTensor, "length_per_key", lambda self: calls.append(1) or original(self))
    ctx = ShardingContext()
    sharding.input_dist(ctx, kjt)
    assert ctx.sent_lengths_per_key == [3] * features
    assert len(calls) <= 2, f"length_per_key read {len(calls)} times for {features} features"


def _dense_dp_tables(rows_per_table, dim=16):
    return [
        sharded_table(
            EmbeddingBagConfig(rows, dim, name=f"t{i}", feature_names=[f"f{i}"]),
            data_parallel()(f"t{i}", (rows, dim), 2, 2, "cpu"),
            2,
        )
        for i, rows in enumerate(rows_per_table)
    ]


def test_dense_kernel_holds_its_tables_in_parameters_of_at_most_4_mib():
    # one parameter of the whole table set made torch.optim.Adagrad's sqrt allocate a fresh temporary
    # of its size every step (32 MiB in the vs_torchrec sweep's data-parallel row): ~1.5x its CPU time
    # fp32 x dim 16: 2 MiB, 2 MiB, 2 MiB, 5 MiB (alone, above the cap), 64 KiB
    tables = _dense_dp_tables([32768, 32768, 32768, 81920, 1024])
    sharding = DpPooledEmbeddingSharding(tables, ShardingEnv.from_local(2, 0), True)
    lookup = sharding.create_lookup()
    params = [p for _, p in lookup.named_parameters()]
    assert [[t.name for t, _ in group] for group in lookup.placed] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert [p.numel() * 4 for p in params] == [4 << 20, 2 << 20, 5 << 20, 64 << 10]
    # the received keys (the input's order and the output's columns) are the tables' order, as before
    assert sharding.received_features() == [f"f{i}" for i in range(5)]
    assert list(lookup.local_shards()) == [
        (f"t{i}", 0, t.config.num_embeddings, 0, 16) for i, t in enumerate(tables)
    ]


@pytest.mark.parametrize("pooled", [True, False])
def test_split_dense_replicas_train_exactly_like_one_group(monkeypatch, pooled):
    # the same forward, gradients and torch.optim.Adagrad steps as one (width, dtype) group
    import importlib

    import torch

    from shardkit.sharding.embedding_lookup import ShardedGroupedLookup
    from shardkit.sparse import KeyedJaggedTensor

    # the module (shardkit.sharding's data_parallel is the plan function)
    dp = importlib.import_module("shardkit.sharding.data_parallel")
    monkeypatch.setattr(dp, "MAX_PARAMETER_BYTES", 30 * 4 * 4)  # 30 rows of dim 4: splits these tables
    rows = [10, 25, 40, 7, 12]
    tables = _dense_dp_tables(rows, dim=4)
    whole = [(t, dp.TableShard(0, 0, r, 0, 4)) for t, r in zip(tables, rows)]
    split = dp.DenseReplicaLookup(whole, pooled)
    one = ShardedGroupedLookup(whole, pooled)
    assert len(split.lookups) == 4 and len(one.lookups) == 1
    gen = torch.Generator().manual_seed(3)
    full = {t.name: torch.randn(r, 4, generator=gen) for t, r in zip(tables, rows)}
    split.load_tables(full.__getitem__)
    one.load_tables(full.__getitem__)
    opt_split = torch.optim.Adagrad(split.parameters(), lr=0.1)
    opt_one = torch.optim.Adagrad(one.parameters(), lr=0.1)
    for step in range(3):
        lengths = torch.randint(0, 4, (len(rows) * 3,), generator=gen)
        ids = torch.cat(
            [
                torch.randint(0, r, (int(n),), generator=gen)
                for r, n in zip(rows, lengths.view(len(rows), 3).sum(1))
            ]
        )
        kjt = KeyedJaggedTensor([f"f{i}" for i in range(len(rows))], ids, lengths=lengths)
        outs = []
        for lookup, opt in [(split, opt_split), (one, opt_one)]:
            opt.zero_grad()
            out = lookup(kjt)
            (out * torch.arange(out.numel()).view_as(out).float()).sum().backward()
            opt.step()
            outs.append(out.detach())
        assert torch.equal(outs[0], outs[1])
        for key, shard in split.local_shards().items():
            assert torch.equal(shard, one.local_shards()[key]), (step, key)


def _sparse_exchange_worker(optimizer, rows=1000):
    """A fused data-parallel table of 1000 x 8 trained on a few ids per rank: the replicas' update is
    the unsharded module's on the global batch, and no collective of the backward moves a buffer of
    the table's size (the touched rows and their gradients travel, not the whole gradient)."""
    import torch
    import torch.distributed as dist

    import shardkit.sharding.replicated_exchange as replicated
    from shardkit.sparse import KeyedJaggedTensor
    from tests.sharding._replicated_case import reference_and_replica

    rank, dim = dist.get_rank(), 8
    reference, sharded = reference_and_replica(rows, dim, optimizer)
    sizes = []

    def recording(collective):
        def run(out, *args, **kwargs):
            sizes.append(out.numel())
            return collective(out, *args, **kwargs)

        return run

    replicated.all_gather_flat = recording(replicated.all_gather_flat)
    replicated.all_gather_blocks = recording(replicated.all_gather_blocks)
    replicated.all_reduce_sum = recording(replicated.all_reduce_sum)
    ids = [torch.tensor([3, 7, 7, 999, 3]) % rows, torch.tensor([7, 500, 0]) % rows]
    lengths = [torch.tensor([2, 3]), torch.tensor([1, 2])]
    grad = torch.arange(4 * dim, dtype=torch.float32).view(4, dim).sin()
    for _ in range(2):
        whole = KeyedJaggedTensor(["f"], torch.cat(ids), lengths=torch.cat(lengths))
        (reference(whole).values() * grad).sum().div(2).backward()
        out = sharded(KeyedJaggedTensor(["f"], ids[rank], lengths=lengths[rank])).values()
        (out * grad[2 * rank : 2 * rank + 2]).sum().backward()
    got = sharded.local_shards()[("d", 0, rows, 0, dim)].clone()
    return got, reference.table_weight("d").detach().clone(), sizes


@pytest.mark.parametrize("optimizer", [OptimType.ADAGRAD, OptimType.ROWWISE_ADAGRAD, OptimType.SGD])
def test_fused_replicas_exchange_the_touched_rows_not_the_table(optimizer):
    import torch

    from shardkit.testing import run_world

    for got, want, sizes in run_world(_sparse_exchange_worker, 2, optimizer):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert sizes and max(sizes) < 1000 * 8, sizes


def test_fused_replicas_with_most_rows_touched_all_reduce_the_dense_gradient():
    """A 4-row table whose rows the ranks all touch: one dense all-reduce (cheaper than the gathers),
    the same step as the unsharded module's."""
    import torch

    from shardkit.testing import run_world

    for got, want, sizes in run_world(_sparse_exchange_worker, 2, OptimType.ADAGRAD, 4):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert 4 * (8 + 1) + 2 in sizes, sizes  # the gradient, a flag per row, a count per rank


def _interleaved_widths_worker(kernel):
    """Data-parallel tables of widths 4, 8, 4, 8 (two lookup groups whose features interleave: every
    batch is permuted into group order and the output columns back), trained 3 steps on each rank's
    own batch: the outputs are the unsharded module's rows of those samples and the tables end as the
    unsharded module's after the same global steps."""
    import torch
    import torch.distributed as dist

    import shardkit.sharding.key_permutation as key_permutation
    from shardkit.modules import EmbeddingBagCollection
    from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
    from shardkit.sharding.sharding_plan import construct_module_sharding_plan
    from shardkit.sparse import KeyedJaggedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    widths = [4, 8, 4, 8]
    configs = [EmbeddingBagConfig(10, d, name=f"t{i}", feature_names=[f"f{i}"]) for i, d in enumerate(widths)]
    fused = FusedOptimizerConfig(OptimType.SGD, lr=0.1) if kernel == "fused" else None

    def ebc():
        torch.manual_seed(0)
        return EmbeddingBagCollection(configs, fused_optimizer=fused)

    reference, module = ebc(), ebc()
    plan = construct_module_sharding_plan(module, {c.name: data_parallel(kernel) for c in configs})
    sharded = EmbeddingBagCollectionSharder().shard(module, plan, ShardingEnv.from_process_group(None))
    applied = []
    real = key_permutation.KeyPermutation.apply
    key_permutation.KeyPermutation.apply = lambda self, kjt: applied.append(self.indices) or real(self, kjt)
    keys = [c.feature_names[0] for c in configs]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        batches = []
        for _r in range(world):  # every rank draws every rank's batch: the reference trains on all
            lengths = torch.randint(0, 3, (len(keys) * 2,), generator=gen)
            batches.append((torch.randint(0, 10, (int(lengths.sum()),), generator=gen), lengths))
        ref_out = [reference(KeyedJaggedTensor(keys, v, lengths=n)).values() for v, n in batches]
        out = sharded(KeyedJaggedTensor(keys, *batches[rank][:1], lengths=batches[rank][1])).values()
        # (after the first step: the replicas summed the ranks' gradients in another order, ~1e-8)
        torch.testing.assert_close(out, ref_out[rank], rtol=1e-6, atol=1e-6)
        # the mean over the ranks' samples, as the data-parallel gradient division makes it
        torch.cat(ref_out).pow(2).sum().div(world).backward()
        out.pow(2).sum().backward()
        if fused is None:  # the dense kernel: the wrapper's all-reduce and a dense step, by hand
            for p in sharded.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
                p.data.add_(p.grad, alpha=-0.1)
                p.grad = None
            for p in reference.parameters():
                p.data.add_(p.grad, alpha=-0.1)
                p.grad = None
    key_permutation.KeyPermutation.apply = real
    state = sharded.local_shards()
    return applied, [
        (state[(c.name, 0, 10, 0, c.embedding_dim)].clone(), reference.table_weight(c.name).detach().clone())
        for c in configs
    ]


@pytest.mark.parametrize("kernel", ["fused", "dense"])
def test_tables_of_interleaved_widths_train_exactly(kernel):
    import torch

    from shardkit.testing import run_world

    for applied, tables in run_world(_interleaved_widths_worker, 2, kernel):
        assert applied == [[0, 2, 1, 3]] * 3  # the batch into group order, once per step
        for got, want in tables:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
