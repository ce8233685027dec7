"""Several groups' fused lookups from one autograd node against each group's own forward and a cat."""

from __future__ import annotations

import copy

import pytest
import torch

from shardkit.distributed.validation import set_validation, validation_enabled
from shardkit.kernels import kernel_backend
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedOptimizerConfig,
    GroupedEmbeddingLookup,
    PoolingType,
    ShardSpec,
    embedding_bag_collection,
)
from shardkit.modules.fused_groups import FusedGroupsLookup, fuses_groups, lookup_pooled_groups
from shardkit.sparse import KeyedJaggedTensor

BATCH = 5


def _groups(optimizer: str) -> list:
    """Three groups of widths 4 / 6 / 3: a MEAN table, row shards of a table with an offset start (bag
    shifts), two tables of one width in one buffer."""
    fused = FusedOptimizerConfig(optimizer, lr=0.1)
    a = EmbeddingBagConfig(30, 4, name="a", feature_names=["a0", "a1"], pooling=PoolingType.MEAN)
    b = EmbeddingBagConfig(40, 6, name="b", feature_names=["b0"])
    c = EmbeddingBagConfig(10, 3, name="c", feature_names=["c0"])
    d = EmbeddingBagConfig(12, 3, name="d", feature_names=["d0"], pooling=PoolingType.MEAN)
    torch.manual_seed(0)
    return [
        GroupedEmbeddingLookup([ShardSpec(a)], pooled=True, fused_optimizer=fused),
        GroupedEmbeddingLookup([ShardSpec(b, row_start=15)], pooled=True, fused_optimizer=fused),
        GroupedEmbeddingLookup([ShardSpec(c), ShardSpec(d)], pooled=True, fused_optimizer=fused),
    ]


def _batch(lookup: GroupedEmbeddingLookup, generator: torch.Generator, weighted: bool):
    """Ids inside each feature's shard, bags of 0-3 ids (empty bags included)."""
    ids, lengths = [], []
    for shard in lookup.shards:
        for _ in shard.config.feature_names:
            n = torch.randint(0, 4, (BATCH,), generator=generator)
            lengths.append(n)
            ids.append(torch.randint(shard.row_start, shard.row_end, (int(n.sum()),), generator=generator))
    lengths = torch.cat(lengths)
    values = torch.cat(ids)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    weights = torch.rand(values.shape, generator=generator) if weighted else None
    return values, offsets, [BATCH] * len(lookup.feature_names), weights


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("optimizer", ["SGD", "ROWWISE_ADAGRAD", "ADAM"])
@pytest.mark.parametrize("weighted", [False, True])
def test_one_node_gives_what_each_group_and_a_cat_give(backend, optimizer, weighted):
    alone = _groups(optimizer)
    together = copy.deepcopy(alone)
    generator = torch.Generator().manual_seed(1)
    with kernel_backend(backend):
        for _ in range(3):  # steps: the optimizer state and the rows move between them
            batches = [_batch(lookup, generator, weighted) for lookup in alone]
            expected = torch.cat([g(*b[:3], b[3], sample_major=True) for g, b in zip(alone, batches)], dim=1)
            grad = torch.randn(expected.shape, generator=generator)
            expected.backward(grad)
            assert fuses_groups(together, torch.float32)
            inputs = [g.kernel_inputs(*b[:3], b[3], sample_major=True) for g, b in zip(together, batches)]
            got = FusedGroupsLookup.apply(together, inputs, *[g.weight for g in together])
            assert got.requires_grad
            got.backward(grad)
            assert torch.equal(got, expected)
            for mine, theirs in zip(together, alone):
                assert torch.equal(mine.weight, theirs.weight)
                assert mine.weight.grad is None
                for (name, state), (_, expected_state) in zip(
                    mine.optimizer.named_buffers(), theirs.optimizer.named_buffers()
                ):
                    assert torch.equal(state, expected_state), name
                assert mine.optimizer.step_count == theirs.optimizer.step_count


def _parts(groups, generator, weights_need_grad=False, samples=BATCH):
    """One KJT a group (its features), as a collection's split gives them."""
    parts = []
    for lookup in groups:
        values, offsets, bags, _ = _batch(lookup, generator, False)
        lengths = offsets.diff()
        if samples == 0:
            values, lengths = values[:0], lengths[:0]
        weights = torch.rand(values.shape, generator=generator, requires_grad=weights_need_grad)
        parts.append(KeyedJaggedTensor(lookup.feature_names, values, weights, lengths=lengths))
    return parts


def test_where_one_node_does_not_apply():
    groups = _groups("SGD")
    generator = torch.Generator().manual_seed(3)
    assert fuses_groups(groups, torch.float32)
    assert lookup_pooled_groups(groups, _parts(groups, generator), torch.float32, True) is not None
    assert not fuses_groups(groups, torch.float16)  # the outputs would need a cast
    with torch.no_grad():
        assert not fuses_groups(groups, torch.float32)
    handle = groups[1].register_forward_hook(lambda *args: None)
    assert not fuses_groups(groups, torch.float32)  # a hook must see its module's call
    handle.remove()
    dense = GroupedEmbeddingLookup(groups[0].shards, pooled=True)  # no fused optimizer: dense gradient
    assert not fuses_groups([dense, *groups[1:]], torch.float32)
    frozen = copy.deepcopy(groups)
    frozen[2].weight.requires_grad_(False)
    assert not fuses_groups(frozen, torch.float32)
    # the weights' own gradients, and zero samples, take each group's own forward
    need_grad = _parts(groups, generator, weights_need_grad=True)
    assert lookup_pooled_groups(groups, need_grad, torch.float32, True) is None
    assert lookup_pooled_groups(groups, need_grad, torch.float32, False) is not None  # weights unused
    assert lookup_pooled_groups(groups, _parts(groups, generator, samples=0), torch.float32, False) is None


def test_an_unsharded_collection_of_several_widths_trains_as_each_group_alone(monkeypatch):
    tables = [
        EmbeddingBagConfig(20 + i, (4, 6, 8)[i % 3], name=f"t{i}", feature_names=[f"f{i}"]) for i in range(6)
    ]
    torch.manual_seed(0)
    fused = EmbeddingBagCollection(tables, fused_optimizer=FusedOptimizerConfig("ADAGRAD", lr=0.1))
    alone = copy.deepcopy(fused)
    calls = []

    def counted(*args):
        out = lookup_pooled_groups(*args)
        calls.append(out is not None)
        return out

    generator = torch.Generator().manual_seed(4)
    for _ in range(3):
        lengths = torch.randint(0, 4, (6 * BATCH,), generator=generator)
        values = torch.randint(0, 20, (int(lengths.sum()),), generator=generator)
        kjt = KeyedJaggedTensor([f"f{i}" for i in range(6)], values, lengths=lengths)
        monkeypatch.setattr(embedding_bag_collection, "lookup_pooled_groups", lambda *args: None)
        expected = alone(kjt).values()
        monkeypatch.setattr(embedding_bag_collection, "lookup_pooled_groups", counted)
        got = fused(kjt).values()
        grad = torch.randn(expected.shape, generator=generator)
        expected.backward(grad)
        got.backward(grad)
        assert torch.equal(got, expected)
    assert calls == [True] * 3
    for name in (table.name for table in tables):
        assert torch.equal(fused.table_weight(name), alone.table_weight(name))


def test_an_id_outside_its_shard_names_its_feature_with_validation_off():
    groups = _groups("SGD")
    generator = torch.Generator().manual_seed(2)
    was = validation_enabled()
    set_validation(False)
    try:
        batches = [_batch(lookup, generator, False) for lookup in groups]
        values, offsets, bags, _ = batches[1]
        values[0] = 10**6  # far outside group 1's buffer of 25 rows
        inputs = [g.kernel_inputs(*b[:3], sample_major=True) for g, b in zip(groups, batches)]
        before = [g.weight.detach().clone() for g in groups]
        with pytest.raises(IndexError, match="feature 'b0'"):
            FusedGroupsLookup.apply(groups, inputs, *[g.weight for g in groups])
        assert all(torch.equal(g.weight, w) for g, w in zip(groups, before))
    finally:
        set_validation(was)
