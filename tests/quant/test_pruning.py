"""Row pruning with index remapping: kept ids look up exactly the unpruned quantized rows, dropped ids
look up zeros, the report counts the bytes, and the pruned collection sharded (table- and row-wise at
world 2) equals it unsharded.

The reference for each case is the unpruned quantized module with the dropped rows' stored bytes set to
zero (codes, scale and bias zero decode to 0.0): the pruned module must equal it exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    PoolingType,
)
from shardkit.quant import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from shardkit.quant.pruning import prune_rows
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world

ROWS = {"t_a": 40, "t_b": 24, "t_c": 10}
KEEP = {"t_a": [3, 0, 17, 39, 17, 8], "t_b": list(range(0, 24, 3))}  # t_c kept whole


def _quantized(pooled: bool, data_type=DataType.INT8):
    torch.manual_seed(0)
    if pooled:
        tables = [
            EmbeddingBagConfig(rows, 8, name=name, feature_names=[name[2:]], pooling=pooling)
            for (name, rows), pooling in zip(
                ROWS.items(), (PoolingType.SUM, PoolingType.MEAN, PoolingType.SUM)
            )
        ]
        return QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(tables), data_type=data_type)
    tables = [EmbeddingConfig(rows, 8, name=name, feature_names=[name[2:]]) for name, rows in ROWS.items()]
    return QuantEmbeddingCollection.from_float(EmbeddingCollection(tables), data_type=data_type)


def _kjt(seed: int, batch: int = 5) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    keys = [name[2:] for name in ROWS]
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=gen)
    per_key = lengths.view(len(keys), batch).sum(1).tolist()
    values = torch.cat(
        [torch.randint(0, rows, (n,), generator=gen) for rows, n in zip(ROWS.values(), per_key)]
    )
    return KeyedJaggedTensor(keys, values, lengths=lengths)


def _zeroed(module, keep):
    """The unpruned module with every dropped row's stored bytes set to zero."""
    reference = copy.deepcopy(module)
    with torch.no_grad():
        for name, ids in keep.items():
            dropped = torch.ones(ROWS[name], dtype=torch.bool)
            dropped[torch.as_tensor(ids)] = False
            reference.table_weight(name)[dropped] = 0
    return reference


def _values(out, pooled: bool):
    return [out.values()] if pooled else [out[k].values() for k in sorted(out)]


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.FP16])
@pytest.mark.parametrize("pooled", [True, False], ids=["ebc", "ec"])
def test_kept_rows_exact_dropped_rows_zero(pooled, data_type):
    module = _quantized(pooled, data_type)
    pruned = prune_rows(module, keep_rows=KEEP)
    reference = _zeroed(module, KEEP)
    for seed in range(4):
        got, want = _values(pruned(_kjt(seed)), pooled), _values(reference(_kjt(seed)), pooled)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    # the stored rows of the pruned tables: the kept unpruned rows in id order, then one zero row
    for name, ids in KEEP.items():
        kept = sorted(set(ids))
        table = pruned.embeddings.table_weight(name)
        assert table.shape[0] == len(kept) + 1
        assert torch.equal(table[:-1], module.table_weight(name)[kept])
        assert not table[-1].any()
        remap = pruned.remapping(name)
        assert remap.dtype == torch.int32 and remap.numel() == ROWS[name]
        assert remap[kept].tolist() == list(range(len(kept))) and int((remap == len(kept)).sum()) == ROWS[
            name
        ] - len(kept)
    # a sequence lookup of a dropped id is a zero row; of a kept id, the unpruned row
    if not pooled:
        kjt = KeyedJaggedTensor(["a", "b", "c"], torch.tensor([1, 3, 0, 5]), lengths=torch.tensor([2, 1, 1]))
        out = pruned(kjt)["a"].values()
        assert not out[0].any() and torch.equal(out[1], module(kjt)["a"].values()[1])


def test_report_counts_bytes():
    module = _quantized(True)
    pruned = prune_rows(module, keep_rows=KEEP)
    report = {t.name: t for t in pruned.report.tables}
    row_bytes = module.table_weight("t_a").shape[1]  # 8 int8 codes + 4 bytes of scale and bias
    assert report["t_a"].kept == 5 and report["t_a"].rows == 40
    assert report["t_a"].bytes_before == 40 * row_bytes
    assert report["t_a"].bytes_after == 6 * row_bytes + 40 * 4  # kept + zero row, int32 remapping
    assert report["t_c"].bytes_before == report["t_c"].bytes_after == 10 * row_bytes
    assert pruned.report.bytes_saved == sum(t.bytes_before - t.bytes_after for t in report.values()) > 0
    assert "total:" in str(pruned.report)


def test_row_norm_threshold_keeps_the_larger_rows():
    float_ebc = EmbeddingBagCollection([EmbeddingBagConfig(40, 8, name="t_a", feature_names=["a"])])
    with torch.no_grad():  # rows 0-9 near zero: their dequantized norm is under the threshold
        float_ebc.table_weight("t_a")[:10] = 1e-4
        float_ebc.table_weight("t_a")[10:] = 0.5
    module = QuantEmbeddingBagCollection.from_float(float_ebc, data_type=DataType.INT8)
    pruned = prune_rows(module, row_norm_threshold=0.1)
    assert pruned.report.tables[0].kept == 30
    assert pruned.remapping("t_a")[:10].eq(30).all() and pruned.remapping("t_a")[10:].tolist() == list(
        range(30)
    )


def test_bad_input_names_what_is_wrong():
    module = _quantized(True)
    with pytest.raises(ValueError, match="exactly one of keep_rows and row_norm_threshold"):
        prune_rows(module)
    with pytest.raises(ValueError, match=r"keep_rows names tables \['t_x'\]"):
        prune_rows(module, keep_rows={"t_x": [0]})
    with pytest.raises(ValueError, match=r"keep_rows\['t_a'\]: ids \[40\] outside \[0, 40\)"):
        prune_rows(module, keep_rows={"t_a": [0, 40]})
    with pytest.raises(TypeError, match="QuantEmbeddingBagCollection or QuantEmbeddingCollection"):
        prune_rows(torch.nn.Linear(2, 2), keep_rows={})
    pruned = prune_rows(module, keep_rows=KEEP)
    bad = KeyedJaggedTensor(["a", "b", "c"], torch.tensor([40, 0, 0]), lengths=torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match=r"feature 'a': ids \[40\] outside \[0, 40\) \(table 't_a'\)"):
        pruned(bad)


def _sharded_worker(pooled: bool, sharding: str) -> bool:
    import torch.distributed as dist

    from shardkit.sharding.quant_embedding import QuantEmbeddingCollectionSharder
    from shardkit.sharding.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
    from shardkit.sharding.sharding_plan import construct_module_sharding_plan, row_wise, table_wise

    rank, world_size = dist.get_rank(), dist.get_world_size()
    module = _quantized(pooled)
    pruned = prune_rows(module, keep_rows=KEEP)
    reference = _zeroed(module, KEEP)
    sharder = QuantEmbeddingBagCollectionSharder() if pooled else QuantEmbeddingCollectionSharder()
    if sharding == "table_wise":
        gens = {name: table_wise(rank=i % world_size, compute_kernel="quant") for i, name in enumerate(ROWS)}
    else:
        gens = {name: row_wise(compute_kernel="quant") for name in ROWS}
    plan = construct_module_sharding_plan(pruned.embeddings, gens, sharder=sharder, world_size=world_size)
    served = copy.deepcopy(pruned)
    served.embeddings = sharder.shard(served.embeddings, plan, ShardingEnv.from_process_group(None))
    for seed in range(3):
        batches = [_kjt(seed * 10 + r, 2 + r) for r in range(world_size)]
        got = _values(served(batches[rank]), pooled)
        want = _values(reference(batches[rank]), pooled)
        for g, w in zip(got, want):
            torch.testing.assert_close(
                g, w, rtol=1e-6, atol=1e-7
            )  # pooled row-wise: partial sums reorder adds
    return True


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
@pytest.mark.parametrize("pooled", [True, False], ids=["ebc", "ec"])
def test_sharded_pruned_equals_unpruned_with_zeroed_rows(pooled, sharding):
    assert all(run_world(_sharded_worker, 2, pooled, sharding))
