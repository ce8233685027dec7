"""Fused data-parallel tables of several widths: their groups' lookups from one autograd node and their
sparse gathers as one all-gather (``_ReplicatedGroupsFn``) train bit for bit as each group alone, through
every way of the exchange (the first counts gather, the joint gather, a gather again when a rank touches
more rows than there was room for, the dense all-reduce), with and without per-id weights, and as the
unsharded module does."""

from __future__ import annotations

import pytest

# (rows, dim): widths 2 / 3 / 4 / 8 / 16 are five lookup groups; the 4- and 5-row tables' rows are all
# touched (their groups take the dense way), the others take the sparse way
TABLES = [(4, 2), (5, 3), (50, 8), (200, 4), (300, 16), (60, 8)]
BAG_LENGTHS = [2, 2, 2, 12, 1, 2]  # the largest bag per step: step 3 touches many more rows (a gather again)


def _worker(sorted_rows: bool, weighted: bool):
    import torch
    import torch.distributed as dist

    import shardkit.sharding.embedding_lookup as embedding_lookup
    import shardkit.sharding.replicated_fused_lookup as replicated
    from shardkit.distributed.sharding_env import ShardingEnv
    from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
    from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
    from shardkit.sharding.sharding_plan import construct_module_sharding_plan, data_parallel
    from shardkit.sparse import KeyedJaggedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    exchange_class = replicated.DenseRowExchange
    patched = []  # (owner, name, original): put back at the end (the test worker lives on)
    calls = {"joint gather": [], "joint all-reduce": [], "gather alone": [], "dense alone": []}

    def count(owner, name, log, size=lambda *args: 1):
        real = getattr(owner, name)
        patched.append((owner, name, real))

        def counted(*args):
            calls[log].append(size(*args))
            return real(*args)

        setattr(owner, name, counted)

    if sorted_rows:  # the way of a table too large for the kept per-row marks
        patched.append((replicated, "uses_scratch", replicated.uses_scratch))
        replicated.uses_scratch = lambda *args: False
    count(replicated, "gather_groups", "joint gather", lambda parts, *_: len(parts))
    count(replicated, "all_reduce_groups", "joint all-reduce", lambda parts, *_: len(parts))
    count(exchange_class, "gather", "gather alone")
    count(exchange_class, "all_reduce_and_step", "dense alone")
    real_pooled = embedding_lookup.lookup_pooled_groups
    regathers = []
    keys = [f"f{i}" for i in range(len(TABLES))]
    configs = [
        EmbeddingBagConfig(r, d, name=f"t{i}", feature_names=[keys[i]]) for i, (r, d) in enumerate(TABLES)
    ]
    try:
        for optimizer in ("SGD", "ROWWISE_ADAGRAD"):

            def ebc(optimizer=optimizer):
                torch.manual_seed(0)
                fused = FusedOptimizerConfig(optimizer, lr=0.1)
                return EmbeddingBagCollection(configs, is_weighted=weighted, fused_optimizer=fused)

            reference = ebc()
            plan = construct_module_sharding_plan(reference, {c.name: data_parallel() for c in configs})
            env = ShardingEnv.from_process_group(None)
            joint = EmbeddingBagCollectionSharder().shard(ebc(), plan, env)
            alone = EmbeddingBagCollectionSharder().shard(ebc(), plan, env)
            gen = torch.Generator().manual_seed(1)
            for longest in BAG_LENGTHS:
                batches = []
                for _r in range(world):  # every rank draws every rank's batch: the reference trains on all
                    lengths = torch.randint(0, longest + 1, (len(keys) * 3,), generator=gen)
                    per_key = lengths.view(len(keys), 3).sum(1).tolist()
                    values = torch.cat(
                        [torch.randint(0, r, (n,), generator=gen) for (r, _), n in zip(TABLES, per_key)]
                    )
                    weights = torch.rand(values.shape, generator=gen) if weighted else None
                    batches.append((values, lengths, weights))
                # the global batch in one forward (rank 0's samples first): one fused step per step, as
                # the replicas take (two forwards would step Adagrad twice)
                parts = [KeyedJaggedTensor(keys, v, w, lengths=n).to_dict() for v, n, w in batches]
                values = torch.cat([p[k].values() for k in keys for p in parts])
                lengths = torch.cat([p[k].lengths() for k in keys for p in parts])
                weights = torch.cat([p[k].weights() for k in keys for p in parts]) if weighted else None
                ref_out = reference(KeyedJaggedTensor(keys, values, weights, lengths=lengths)).values()
                grad = torch.randn(ref_out.shape, generator=gen)
                (ref_out * grad).sum().div(world).backward()
                expected, grad = ref_out[3 * rank : 3 * rank + 3].detach(), grad[3 * rank : 3 * rank + 3]
                values, lengths, weights = batches[rank]
                mine = KeyedJaggedTensor(keys, values, weights, lengths=lengths)
                embedding_lookup.lookup_pooled_groups = lambda *args: None
                try:
                    out_alone = alone(mine).values()
                    (out_alone * grad).sum().backward()
                finally:
                    embedding_lookup.lookup_pooled_groups = real_pooled
                before = len(calls["gather alone"])
                out = joint(mine).values()
                (out * grad).sum().backward()
                if longest == max(BAG_LENGTHS):  # the joint gather had too little room: gathers again
                    regathers.append(len(calls["gather alone"]) - before)
                assert torch.equal(out, out_alone)
                torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
            mine, theirs = joint.local_shards(), alone.local_shards()
            for (r, d), c in zip(TABLES, configs):
                key = (c.name, 0, r, 0, d)
                assert torch.equal(mine[key], theirs[key]), key
                torch.testing.assert_close(
                    mine[key], reference.table_weight(c.name).detach(), rtol=1e-5, atol=1e-6
                )
    finally:
        for owner, name, real in reversed(patched):
            setattr(owner, name, real)
    return calls["joint gather"], calls["joint all-reduce"], regathers, len(calls["dense alone"])


@pytest.mark.parametrize(
    "world_size, sorted_rows, weighted",
    [(2, False, False), (3, False, False), (2, True, False), (2, False, True)],
)
def test_replicated_groups_train_as_each_group_alone(world_size, sorted_rows, weighted):
    from shardkit.testing import run_world

    for joint_gathers, joint_reduces, regathers, dense in run_world(
        _worker, world_size, sorted_rows, weighted
    ):
        # the sparse groups gather together from their second step on, in both optimizers' runs (at
        # 3 ranks the long bags' counts may send a group the dense way for the next step)
        assert len(joint_gathers) >= len(BAG_LENGTHS) and all(n >= 2 for n in joint_gathers), joint_gathers
        assert all(n > 0 for n in regathers), regathers  # the long bags' step gathered again
        # the two tiny tables' groups: one dense all-reduce together from their second step on (but
        # after a step of few ids, whose counts send them the sparse way), alone in the other module
        assert len(joint_reduces) >= 2 * 2 and set(joint_reduces) == {2}, joint_reduces
        assert dense >= 2 * 2 * len(BAG_LENGTHS), dense
