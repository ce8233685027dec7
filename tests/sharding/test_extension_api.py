"""The single-process pieces of the extension API (torchrec's names for user-written sharded modules):
table descriptions, contexts, awaitables, the output KeyedTensor, the sharding infos, the bucketing of
ids before a row-wise all-to-all, and parameter initialization. The multi-rank use is in
test_custom_sharder.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.distributed.awaitable import NoWait
from shardkit.distributed.embedding_lookup import (
    CommOpGradientScaling,
    embeddings_cat_empty_rank_handle,
    fx_wrap_tensor_view2d,
)
from shardkit.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    EmbeddingSharding,
    EmbeddingShardingContext,
    KJTListSplitsAwaitable,
    bucketize_kjt_before_all2all,
)
from shardkit.distributed.embedding_types import (
    GroupedEmbeddingConfig,
    ShardedEmbeddingTable,
    compute_kernel_to_embedding_location,
)
from shardkit.distributed.embeddingbag import (
    EmbeddingBagCollectionAwaitable,
    construct_output_kt,
    create_sharding_infos_by_sharding,
    replace_placement_with_meta_device,
)
from shardkit.distributed.sharding.sequence_sharding import SequenceShardingContext
from shardkit.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from shardkit.distributed.utils import init_parameters
from shardkit.modules.embedding_configs import EmbeddingBagConfig, EmbeddingTableConfig, PoolingType
from shardkit.modules.embedding_modules import EmbeddingBagCollection
from shardkit.sharding.sharded_embedding_table import EmbeddingLocation
from shardkit.sharding.types import EmbeddingComputeKernel
from shardkit.sparse.jagged_tensor import KeyedJaggedTensor
from shardkit.streamable import Multistreamable


def test_interfaces_are_abstract_until_implemented():
    with pytest.raises(TypeError):
        EmbeddingSharding()  # the seven abstract methods
    with pytest.raises(TypeError):
        BaseEmbeddingDist()
    assert issubclass(EmbeddingShardingContext, Multistreamable)


def test_sharded_embedding_table_and_grouped_config():
    tables = [
        ShardedEmbeddingTable(
            num_embeddings=10,
            embedding_dim=8,
            name="a",
            feature_names=["x", "y"],
            local_rows=10,
            local_cols=4,
        ),
        ShardedEmbeddingTable(
            num_embeddings=6,
            embedding_dim=2,
            name="b",
            feature_names=["z"],
            embedding_names=["z@b"],
            local_cols=2,
        ),
    ]
    assert tables[0].compute_kernel is EmbeddingComputeKernel.DENSE and tables[0].pooling is PoolingType.SUM
    group = GroupedEmbeddingConfig(
        tables[0].data_type, PoolingType.SUM, False, False, EmbeddingComputeKernel.DENSE, tables
    )
    assert group.feature_names() == ["x", "y", "z"]
    assert group.embedding_names() == ["x", "y", "z@b"]
    assert group.embedding_dims() == [4, 4, 2]  # a shard's width, not the table's
    assert group.dim_sum() == 10
    assert group.feature_hash_sizes() == [10, 10, 6]
    assert group.table_names() == ["a", "b"] and group.num_features() == 3
    with pytest.raises(ValueError, match="embedding_names"):
        EmbeddingTableConfig(
            num_embeddings=4, embedding_dim=2, name="t", feature_names=["f"], embedding_names=[]
        )
        EmbeddingTableConfig(
            num_embeddings=4, embedding_dim=2, name="t", feature_names=["f"], embedding_names=["a", "b"]
        )


def test_compute_kernel_to_embedding_location():
    assert compute_kernel_to_embedding_location(EmbeddingComputeKernel.FUSED) is EmbeddingLocation.DEVICE
    assert compute_kernel_to_embedding_location("fused_uvm") is EmbeddingLocation.MANAGED
    assert compute_kernel_to_embedding_location("quant_uvm_caching") is EmbeddingLocation.MANAGED_CACHING
    with pytest.raises(ValueError, match="unknown compute kernel 'sparse'"):
        compute_kernel_to_embedding_location("sparse")


def test_construct_output_kt_and_awaitable():
    a, b = torch.arange(6.0).view(2, 3), torch.ones(2, 2)
    kt = construct_output_kt([a, b], ["p", "q"], [3, 2])
    assert torch.equal(kt["p"], a) and torch.equal(kt["q"], b)
    kt = EmbeddingBagCollectionAwaitable([NoWait(a), NoWait(b)], [1, 2, 2], ["p1", "p2", "q"]).wait()
    assert kt.keys() == ["p1", "p2", "q"] and torch.equal(kt["p2"], a[:, 1:])
    with pytest.raises(ValueError, match="sum to 4 but the embeddings have 5 columns"):
        construct_output_kt([a, b], ["p", "q"], [2, 2])


class _FakeTensorsAwaitable(NoWait):
    """What a KJT all-to-all's phase two exposes before ``wait()``."""

    def __init__(self, kjt) -> None:
        super().__init__(kjt)
        self.stride_per_rank = [2, 3]
        self.input_splits = {"lengths": [1, 1], "values": [4, 5]}
        self.output_splits = {"lengths": [1, 1], "values": [6, 7]}
        self.recat = torch.tensor([0, 1])


def test_kjt_list_splits_awaitable_fills_the_sharding_contexts():
    kjt = KeyedJaggedTensor(["f"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 2]))

    class Ctx:
        sharding_contexts = [EmbeddingShardingContext(), SequenceShardingContext()]

    ctx = Ctx()
    splits = KJTListSplitsAwaitable(
        [NoWait(_FakeTensorsAwaitable(kjt)), NoWait(_FakeTensorsAwaitable(kjt))], ctx
    )
    kjts = splits.wait().wait()
    assert len(kjts) == 2 and kjts[0] is kjt
    pooled, sequence = ctx.sharding_contexts
    assert pooled.batch_size_per_rank == [2, 3] and sequence.batch_size_per_rank == [2, 3]
    assert sequence.input_splits == [4, 5] and sequence.output_splits == [6, 7]
    assert torch.equal(sequence.sparse_features_recat, torch.tensor([0, 1]))


def test_bucketize_kjt_before_all2all():
    # keys a (block 4), b (block 5); two buckets; bags a: [0, 5], [3]; b: [9, 1], [7]
    kjt = KeyedJaggedTensor(
        ["a", "b"], torch.tensor([0, 5, 3, 9, 1, 7]), torch.arange(6.0), lengths=torch.tensor([2, 1, 2, 1])
    )
    out, permute = bucketize_kjt_before_all2all(kjt, 2, torch.tensor([4, 5]), output_permute=True)
    assert out.keys() == ["a", "b", "a", "b"]
    assert out.lengths().tolist() == [1, 1, 1, 0, 1, 0, 1, 1]
    assert out.values().tolist() == [0, 3, 1, 1, 4, 2]  # local rows
    assert out.weights().tolist() == [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]
    assert permute.tolist() == [0, 3, 1, 4, 2, 5]  # input id i sits at out position permute[i]
    assert torch.equal(out.values()[permute], torch.tensor([0, 1, 3, 4, 1, 2]))
    pos, none = bucketize_kjt_before_all2all(kjt, 2, torch.tensor([4, 5]), bucketize_pos=True)
    assert none is None and pos.weights().tolist() == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    # uneven blocks: a's buckets are rows [0, 1) and [1, 12); b's [0, 8) and [8, 12)
    rows = [torch.tensor([0, 1, 12]), torch.tensor([0, 8, 12])]
    uneven, _ = bucketize_kjt_before_all2all(kjt, 2, torch.tensor([4, 5]), block_bucketize_row_pos=rows)
    assert uneven.lengths().tolist() == [1, 0, 1, 1, 1, 1, 1, 0]
    assert uneven.values().tolist() == [0, 1, 7, 4, 2, 1]
    with pytest.raises(ValueError, match="1 block sizes for 2 features"):
        bucketize_kjt_before_all2all(kjt, 2, torch.tensor([4]))


def test_sharding_infos_and_meta_placement():
    configs = [
        EmbeddingBagConfig(num_embeddings=8, embedding_dim=4, name="t0", feature_names=["f", "g"]),
        EmbeddingBagConfig(num_embeddings=6, embedding_dim=4, name="t1", feature_names=["f"]),
    ]
    ebc = EmbeddingBagCollection(tables=configs)
    plan = construct_module_sharding_plan(ebc, {"t0": table_wise(rank=1), "t1": row_wise()}, world_size=2)
    infos = create_sharding_infos_by_sharding(ebc, plan, "embedding_bags.", {"optimizer": "sgd", "lr": 0.1})
    assert list(infos) == ["table_wise", "row_wise"]
    t0, t1 = infos["table_wise"][0], infos["row_wise"][0]
    assert t0.embedding_config.embedding_names == ["f@t0", "g"] and t1.embedding_config.embedding_names == [
        "f@t1"
    ]
    assert t0.param is not None and torch.equal(t0.param, ebc.table_weight("t0"))
    assert t0.fused_params == {"optimizer": "sgd", "lr": 0.1}
    assert t0.param_sharding.ranks == [1]
    replace_placement_with_meta_device(infos["row_wise"])
    assert [s.placement for s in t1.param_sharding.sharding_spec.shards] == ["rank:0/meta", "rank:1/meta"]
    with pytest.raises(KeyError, match=r"lacks table\(s\) \['t1'\]"):
        create_sharding_infos_by_sharding(ebc, {"t0": plan["t0"]}, "embedding_bags.", None)


def test_lookup_helpers():
    x = torch.ones(3, requires_grad=True)
    CommOpGradientScaling.apply(x, 0.25).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 0.25))
    dummy = torch.empty(0)
    assert embeddings_cat_empty_rank_handle([], dummy) is dummy
    one = torch.ones(2, 2)
    assert embeddings_cat_empty_rank_handle([one], dummy) is one
    assert embeddings_cat_empty_rank_handle([one, one], dummy, dim=1).shape == (2, 4)
    assert fx_wrap_tensor_view2d(torch.arange(6), 2, 3).shape == (2, 3)


def test_init_parameters_allocates_only_meta_tensors():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1, device="meta"))
    kept = model[0].weight.detach().clone()
    init_parameters(model, torch.device("cpu"))
    assert model[1].weight.device.type == "cpu" and torch.isfinite(model[1].weight).all()
    assert torch.equal(model[0].weight, kept)  # a materialized module keeps its values


def test_list_of_kjt_list_awaitables_and_embedding_awaitable():
    from shardkit.distributed.embedding_sharding import ListOfKJTListSplitsAwaitable
    from shardkit.distributed.embedding_types import KJTList, ListOfKJTList
    from shardkit.distributed.embeddingbag import EmbeddingAwaitable

    kjt = KeyedJaggedTensor(["f"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    lists = [KJTList([kjt]), KJTList([kjt, kjt])]
    out = ListOfKJTListSplitsAwaitable([NoWait(NoWait(x)) for x in lists]).wait().wait()
    assert isinstance(out, ListOfKJTList) and isinstance(out, Multistreamable)
    assert [len(x) for x in out] == [1, 2] and out[1][0] is kjt
    lazy = EmbeddingAwaitable(NoWait(torch.ones(2, 3)))
    assert torch.equal(lazy + 1, torch.full((2, 3), 2.0))  # used like the tensor


def test_group_tables_per_rank():
    from shardkit.distributed.embedding_sharding import group_tables
    from shardkit.modules.embedding_configs import DataType

    def table(name, kernel="dense", data_type=DataType.FP32, fused=None, rows=10, dim=4):
        return ShardedEmbeddingTable(
            num_embeddings=rows,
            embedding_dim=dim,
            name=name,
            feature_names=[f"{name}_f"],
            data_type=data_type,
            compute_kernel=EmbeddingComputeKernel(kernel),
            local_rows=rows,
            local_cols=dim,
            fused_params=fused,
        )

    cache = {"optimizer": "sgd", "cache_load_factor": 0.2}
    rank0 = [
        table("a"),
        table("b", "fused", fused={"optimizer": "sgd"}),
        table("c", dim=8),  # other widths join the dense group (one group per kernel, not per width)
        table("d", "fused_uvm_caching", fused=cache, rows=30),
        table("e", data_type=DataType.FP16),
        table("f", "fused_uvm_caching", fused={"optimizer": "sgd", "cache_load_factor": 0.6}, rows=10),
    ]
    groups0, groups1 = group_tables([rank0, []])
    assert groups1 == []
    assert [g.table_names() for g in groups0] == [["a", "c"], ["b", "d", "f"], ["e"]]
    assert groups0[1].compute_kernel is EmbeddingComputeKernel.FUSED  # the UVM caching kernel's base
    assert groups0[1].fused_params == {"optimizer": "sgd", "cache_load_factor": pytest.approx(0.3)}
    weighted = table("w")
    weighted.is_weighted = True
    with pytest.raises(ValueError, match=r"tables \['w'\] are weighted"):
        group_tables([[table("a")], [weighted]])
