"""EmbeddingCollection index deduplication (``set_ec_index_dedup(True)``).

Three modules see the same Zipf-distributed ids (many repeats): the unsharded EmbeddingCollection on
the global batch, a ShardedEmbeddingCollection built with the switch off and one built with it on.
Every sharding type (TW, CW with two features on one table, RW with fewer rows than ranks, DP, TWRW,
TWCW) and a feature looked up by two tables, ``need_indices``, zero-sample ranks, fused SGD and
Adagrad over several steps. The deduplicated module must

- return bitwise the rows of the module without deduplication (and the unsharded module's rows);
- end with bitwise the same weights when every gradient sum is exact: dyadic weights and upstream
  gradients, gradient division off or by a power of two; with gradient division at world 3 (dividing
  by 3 rounds) the pre-summed gradients (summed per distinct id before they travel) round
  differently, so weights and later steps' rows are compared to rounding (SGD only: see _worker);
- send fewer ids than the module without deduplication, exactly each feature's distinct ids per rank
  that looks them up.

Ranks that set the switch differently fail on every rank when sharding.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Tuple

import pytest
import torch

from shardkit.distributed.comm_ops.request import get_gradient_division, set_gradient_division
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingCollection, EmbeddingConfig, FusedOptimizerConfig, OptimType
from shardkit.sharding.ec_index_dedup import dedup_features, get_ec_index_dedup, set_ec_index_dedup
from shardkit.sharding.embedding import EmbeddingCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, row_wise
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

LR = 0.125  # a power of two: updates of dyadic weights by dyadic gradients stay exact
STEPS = 3
TOL = dict(rtol=1e-5, atol=1e-6)
# t_shared and t_tw both look up f_tw (outputs f_tw@t_tw and f_tw@t_shared)
EXTRA = ("t_shared", 9, 4, ["f_tw"], None)


def _tables(with_dp: bool):
    return [t for t in case.TABLES if with_dp or t[0] != "t_dp"] + [EXTRA]


def _features(with_dp: bool) -> List[Tuple[str, int]]:
    rows: Dict[str, int] = {}
    for _, n, _, feats, _ in _tables(with_dp):
        for f in feats:
            rows[f] = min(rows.get(f, n), n)
    return list(rows.items())


def _plan(reference, world_size: int, local_size: int, with_dp: bool):
    generators = case.plan_generators(world_size, local_size, with_dp)
    generators["t_shared"] = row_wise()
    return construct_module_sharding_plan(reference, generators, local_size, world_size)


def _module(optimizer: OptimType, with_dp: bool) -> EmbeddingCollection:
    torch.manual_seed(0)
    module = EmbeddingCollection(
        [EmbeddingConfig(n, d, name=name, feature_names=feats) for name, n, d, feats, _ in _tables(with_dp)],
        need_indices=True,
        fused_optimizer=FusedOptimizerConfig(optimizer, lr=LR),
    )
    with torch.no_grad():  # dyadic weights: k / 8
        for name, n, d, _, _ in _tables(with_dp):
            gen = torch.Generator().manual_seed(len(name) * 7 + n)
            module.table_weight(name).copy_(torch.randint(-8, 9, (n, d), generator=gen).float() / 8)
    return module


def _zipf_bags(step: int, rank: int, samples: int, features) -> Dict[str, List[List[int]]]:
    """Rank ``rank``'s bags: 0 to 6 ids each, id k drawn with probability ~ 1 / (k + 1)^1.3."""
    gen = torch.Generator().manual_seed(7919 * step + 104729 * rank + 3)
    out = {}
    for feature, rows in features:
        p = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.3
        lengths = torch.randint(0, 7, (samples,), generator=gen).tolist()
        ids = torch.multinomial(p, max(sum(lengths), 1), replacement=True, generator=gen).tolist()
        starts = [sum(lengths[:i]) for i in range(samples)]
        out[feature] = [ids[s : s + n] for s, n in zip(starts, lengths)]
    return out


def _batches(step, rank, world_size, features, empty):
    sizes = [case.batch_size(r, empty) for r in range(world_size)]
    per_rank = [_zipf_bags(step, r, sizes[r], features) for r in range(world_size)]
    global_kjt = case.to_kjt({f: [b for r in range(world_size) for b in per_rank[r][f]] for f, _ in features})
    local = case.to_kjt(per_rank[rank])
    local = local.permute(list(reversed(range(len(local.keys())))))  # exercise the module's permute
    return global_kjt, local, per_rank


def _upstream(step: int, name: str, shape) -> torch.Tensor:
    """Dyadic upstream gradients (k / 4), the same on every rank for the global batch."""
    gen = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    return torch.randint(-4, 5, tuple(shape), generator=gen).float() / 4


def _ids_sent(sharded, kjt: KeyedJaggedTensor) -> int:
    """Ids this rank sends in the input dists of one forward (no backward follows)."""
    ctx = sharded.create_context()
    sharded.input_dist(ctx, kjt).wait().wait()
    return sum(sum(c.input_splits) for c in ctx.sharding_contexts if c.input_splits is not None)


def _check(optimizer: OptimType, division: bool, empty) -> None:
    rank, world_size, local_size = case.world()
    with_dp = optimizer is OptimType.SGD
    features = _features(with_dp)
    reference = _module(optimizer, with_dp)
    plan = _plan(reference, world_size, local_size, with_dp)
    env = ShardingEnv.from_process_group(None)
    plain = EmbeddingCollectionSharder().shard(copy.deepcopy(reference), plan, env)
    set_ec_index_dedup(True)
    deduped = EmbeddingCollectionSharder().shard(copy.deepcopy(reference), plan, env)
    scale = 1.0 / world_size if division else 1.0
    # every gradient sum is exact unless gradient division divides by a non-power of two (world 3):
    # then the pre-summed gradients round differently and the weights (so later rows) differ slightly
    exact = not division or world_size & (world_size - 1) == 0
    sent_plain = sent_dedup = 0
    for step in range(STEPS):
        global_kjt, local_kjt, per_rank = _batches(step, rank, world_size, features, empty)
        sent_plain += _ids_sent(plain, local_kjt)
        sent_dedup += _ids_sent(deduped, local_kjt)
        expected = reference(global_kjt)
        grads = {name: _upstream(step, name, jt.values().shape) for name, jt in expected.items()}
        (sum((jt.values() * grads[n]).sum() for n, jt in expected.items()) * scale).backward()
        outs = [plain(local_kjt), deduped(local_kjt)]
        for out in outs:
            assert list(out.keys()) == list(expected.keys())
        losses = [0, 0]
        for name, jt in expected.items():
            source = name.split("@")[0]
            counts = [sum(len(b) for b in per_rank[r][source]) for r in range(world_size)]
            mine = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
            a, b = outs[0][name], outs[1][name]
            if exact or step == 0:
                assert torch.equal(b.values(), a.values()), f"rank {rank} step {step} {name}: rows differ"
            else:
                torch.testing.assert_close(
                    b.values(),
                    a.values(),
                    **TOL,
                    msg=lambda m, where=f"{name} {optimizer} step {step}": f"{where}: {m}",
                )
            torch.testing.assert_close(b.values(), jt.values()[mine].detach(), **TOL)
            assert torch.equal(b.weights(), local_kjt[source].values())  # need_indices: the ids
            assert torch.equal(b.lengths(), local_kjt[source].lengths())
            for i, out in enumerate(outs):
                losses[i] = losses[i] + (out[name].values() * grads[name][mine]).sum()
        for loss, module in zip(losses, (plain, deduped)):
            loss.backward()
            case.average_dense_gradients_(module, world_size)
    plain_shards, dedup_shards = plain.local_shards(), deduped.local_shards()
    for key, weight in dedup_shards.items():
        name, r0, r1, c0, c1 = key
        if not exact:
            torch.testing.assert_close(weight, plain_shards[key], **TOL)
        else:
            assert torch.equal(weight, plain_shards[key]), f"rank {rank}: {key} differs from no dedup"
        torch.testing.assert_close(weight, reference.table_weight(name)[r0:r1, c0:c1].detach(), **TOL)
    if rank not in empty:  # Zipf ids repeat: deduplication must send fewer
        assert sent_dedup < sent_plain, (sent_dedup, sent_plain)
    else:
        assert sent_dedup == sent_plain == 0


def _worker(empty) -> bool:
    world_size = case.world()[1]
    division = get_gradient_division()
    try:
        for optimizer in (OptimType.SGD, OptimType.ADAGRAD):
            for on in (False, True):
                if on and optimizer is OptimType.ADAGRAD and world_size & (world_size - 1):
                    # not exact (see the module docstring), and Adagrad's first step turns a rounding
                    # residual of a gradient summing to zero (1e-8 vs 0) into a step of ~lr: a
                    # comparison to rounding means nothing there
                    continue
                set_gradient_division(on)
                set_ec_index_dedup(False)
                _check(optimizer, on, empty)
    finally:
        set_ec_index_dedup(False)
        set_gradient_division(division)
    return True


@pytest.mark.parametrize("world_size, empty", [(1, ()), (2, ()), (2, (0,)), (3, (1,))])
def test_dedup_equals_plain_and_unsharded(world_size, empty):
    assert all(run_world(_worker, world_size, empty))


def test_dedup_features_sends_each_distinct_id_once_per_key():
    kjt = KeyedJaggedTensor(
        ["a", "b", "c"],
        torch.tensor([5, 1, 5, 5, 2, 7, 7, 7], dtype=torch.int64),
        lengths=torch.tensor([2, 2, 0, 1, 3, 0], dtype=torch.int64),
    )
    out, inverse = dedup_features(kjt)
    assert out.keys() == ["a", "b", "c"] and out.stride() == kjt.stride()
    assert out.values().tolist() == [1, 5, 2, 7] and out.lengths().tolist() == [2, 0, 1, 0, 1, 0]
    for key in kjt.keys():
        distinct = out[key].values()
        assert torch.equal(distinct[inverse[key]], kjt[key].values())


def test_dedup_features_zero_samples():
    kjt = KeyedJaggedTensor(
        ["a", "b"], torch.zeros(0, dtype=torch.int64), lengths=torch.zeros(0, dtype=torch.int64), stride=0
    )
    out, inverse = dedup_features(kjt)
    assert out.stride() == 0 and out.values().numel() == 0 and out.lengths().numel() == 0
    assert all(v.numel() == 0 for v in inverse.values())


def test_switch_rejects_non_bool():
    with pytest.raises(TypeError, match="bool"):
        set_ec_index_dedup(1)
    assert get_ec_index_dedup() is False


def _disagree() -> bool:
    rank, world_size, local_size = case.world()
    reference = _module(OptimType.SGD, True)
    plan = _plan(reference, world_size, local_size, True)
    set_ec_index_dedup(rank == 1)
    try:
        case.raises_value_error(
            lambda: EmbeddingCollectionSharder().shard(reference, plan, ShardingEnv.from_process_group(None)),
            "EC index dedup",
            "rank 1: True",
        )
    finally:
        set_ec_index_dedup(False)
    return True


def test_ranks_disagreeing_on_the_switch_fail_on_every_rank():
    assert all(run_world(_disagree, 2))


def _quant_worker() -> bool:
    """The quantized collection (a ShardedEmbeddingCollection) deduplicates too: rows bitwise equal."""
    from shardkit.quant import QuantEmbeddingCollection
    from shardkit.sharding.quant_embedding import QuantEmbeddingCollectionSharder
    from shardkit.sharding.sharding_plan import column_wise, table_wise

    rank, world_size, _ = case.world()
    torch.manual_seed(0)
    tables = [("q_tw", 11, ["a"]), ("q_rw", 13, ["b", "c"]), ("q_cw", 9, ["d"])]
    quantized = QuantEmbeddingCollection.from_float(
        EmbeddingCollection([EmbeddingConfig(n, 8, name=t, feature_names=f) for t, n, f in tables])
    )
    gens = {
        "q_tw": table_wise(rank=world_size - 1, compute_kernel="quant"),
        "q_rw": row_wise(compute_kernel="quant"),
        "q_cw": column_wise(ranks=[0, world_size - 1], compute_kernel="quant"),
    }
    plan = construct_module_sharding_plan(quantized, gens, world_size, world_size)
    env = ShardingEnv.from_process_group(None)
    plain = QuantEmbeddingCollectionSharder().shard(copy.deepcopy(quantized), plan, env)
    set_ec_index_dedup(True)
    try:
        deduped = QuantEmbeddingCollectionSharder().shard(copy.deepcopy(quantized), plan, env)
    finally:
        set_ec_index_dedup(False)
    features = [("a", 11), ("b", 13), ("c", 13), ("d", 9)]
    kjt = case.to_kjt(_zipf_bags(0, rank, case.batch_size(rank), features))
    assert _ids_sent(deduped, kjt) < _ids_sent(plain, kjt)
    a, b = plain(kjt).wait(), deduped(kjt).wait()
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name].values(), b[name].values()), name
    return True


def test_quantized_collection_dedups_bitwise():
    assert all(run_world(_quant_worker, 2))
