"""MC-EBC / MC-EC: remap, evicted rows re-initialized and their fused optimizer state reset before the
lookup, evictions reported, remapped features returned on request."""

from __future__ import annotations

import pytest
import torch

from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedOptimizerConfig,
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
    OptimType,
)
from shardkit.modules.mc_row_reset import reinit_values
from shardkit.sparse import KeyedJaggedTensor

ZCH, DIM = 6, 3


def _mc(tables):
    modules = {t.name: MCHManagedCollisionModule(ZCH, None, LFU_EvictionPolicy(), 1, 1000) for t in tables}
    return ManagedCollisionCollection(modules, tables)


def _batches():
    # ids 1..4 fill four of the five usable slots, then 7, 8 (twice) evict the least frequent
    return [
        KeyedJaggedTensor(["f"], torch.tensor([1, 2, 3, 4, 1]), lengths=torch.tensor([2, 3])),
        KeyedJaggedTensor(["f"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 2])),
        KeyedJaggedTensor(["f"], torch.tensor([7, 8, 8, 9, 9, 9]), lengths=torch.tensor([3, 3])),
    ]


@pytest.mark.parametrize("optimizer", [OptimType.ADAGRAD, OptimType.ROWWISE_ADAGRAD, OptimType.ADAM])
def test_evicted_rows_and_optimizer_state_are_reset_before_the_lookup(optimizer):
    tables = [EmbeddingBagConfig(ZCH, DIM, name="t", feature_names=["f"])]
    config = FusedOptimizerConfig(optimizer, lr=0.1, initial_accumulator_value=0.5)
    ebc = EmbeddingBagCollection(tables, fused_optimizer=config)
    mc_ebc = ManagedCollisionEmbeddingBagCollection(ebc, _mc(tables), return_remapped_features=True)
    state_rows = lambda: {k: v.clone() for k, v in ebc.lookups[0].optimizer.named_buffers()}  # noqa: E731
    for step, kjt in enumerate(_batches(), start=1):
        before, opt_before = ebc.table_weight("t").detach().clone(), state_rows()
        out, remapped = mc_ebc(kjt)
        evicted = mc_ebc.evictions_per_table["t"]
        assert (evicted is None) == (step == 2), step  # step 2 brings no new id
        evicted = torch.empty(0, dtype=torch.int64) if evicted is None else evicted
        after = ebc.table_weight("t").detach()
        kept = torch.ones(ZCH, dtype=torch.bool)
        kept[evicted] = False
        assert torch.equal(after[kept], before[kept])
        assert torch.equal(after[evicted], reinit_values(tables[0], evicted, 0, DIM, step))
        for name, buf in ebc.lookups[0].optimizer.named_buffers():
            assert torch.equal(buf[kept], opt_before[name][kept])
            assert bool((buf[evicted] == (0.5 if name == "sum" else 0.0)).all())
        # the lookup saw the reset rows: bag 0's pooled value is the sum of its slots' rows
        first_bag = remapped.values()[: int(remapped.lengths()[0])]
        assert torch.allclose(out.values()[0], after[first_bag].sum(0))
        out.values().sum().backward()
    # step 3: 9 (three times) and 8 (twice) displaced the least frequent ids; 7 (once) lost to them
    slots = remapped.values().tolist()
    assert slots[0] == ZCH - 1 and len(set(slots[1:])) == 2 and ZCH - 1 not in slots[1:]


def test_sequence_module_and_no_remapped_features_by_default():
    tables = [EmbeddingConfig(ZCH, DIM, name="t", feature_names=["f"])]
    ec = EmbeddingCollection(tables)
    mc_ec = ManagedCollisionEmbeddingCollection(ec, _mc(tables))
    out, remapped = mc_ec(_batches()[0])
    assert remapped is None
    assert out["f"].values().shape == (5, DIM)
    assert mc_ec.evictions_per_table["t"].tolist() == [1, 2, 3, 4]


def test_tables_must_match():
    tables = [EmbeddingBagConfig(ZCH, DIM, name="t", feature_names=["f"])]
    other = [EmbeddingBagConfig(ZCH, DIM + 1, name="t", feature_names=["f"])]
    with pytest.raises(ValueError, match="must have equal configs"):
        ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(other), _mc(tables))


def test_reinit_values_depend_on_slot_column_and_iteration_only():
    table = EmbeddingBagConfig(100, 4, name="t", feature_names=["f"])
    full = reinit_values(table, torch.tensor([3, 70]), 0, 4, 5)
    assert torch.equal(reinit_values(table, torch.tensor([70]), 1, 3, 5), full[1:, 1:3])
    assert not torch.equal(reinit_values(table, torch.tensor([3, 70]), 0, 4, 6), full)
    bound = table.get_weight_init_max()
    assert bool((full.abs() <= bound).all()) and full.unique().numel() == 8
