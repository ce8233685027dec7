"""The specification's ``torchrec.distributed.utils`` helpers (single process)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from shardkit.modules.fused_optimizers import OptimType
from shardkit.sharding import ParameterSharding, ShardedModule
from shardkit.sharding.dist_data import PermutePooledEmbeddings
from shardkit.sharding.utils import (
    CopyableMixin,
    add_params_from_parameter_sharding,
    add_prefix_to_state_dict,
    append_prefix,
    copy_to_device,
    filter_state_dict,
    get_unsharded_module_names,
    merge_fused_params,
    none_throws,
    optimizer_type_to_emb_opt_type,
)
from shardkit.sharding.utils import PermutePooledEmbeddings as UtilsPermute


def test_none_throws():
    assert none_throws(0) == 0 and none_throws("") == ""  # falsy values are values
    with pytest.raises(AssertionError, match="Unexpected `None`"):
        none_throws(None)
    with pytest.raises(AssertionError, match="no table"):
        none_throws(None, "no table")


@pytest.mark.parametrize(
    "prefix, name, expected",
    [
        ("a", "b", "a.b"),
        ("a.", "b", "a.b"),
        ("", "b", "b"),
        ("a", "", "a"),
        ("", "", ""),
        ("a.b", "c.d", "a.b.c.d"),
    ],
)
def test_append_prefix(prefix, name, expected):
    assert append_prefix(prefix, name) == expected


def test_filter_state_dict_keeps_the_module_and_strips_its_name():
    w, b, o = torch.ones(1), torch.zeros(1), torch.full((1,), 2.0)
    sd = OrderedDict([("ebc.t2.weight", w), ("dense.bias", b), ("ebc2.weight", o), ("ebc.t1.weight", b)])
    out = filter_state_dict(sd, "ebc")
    assert list(out) == ["t2.weight", "t1.weight"]  # order kept; "ebc2" is another module
    assert out["t2.weight"] is w  # no copies
    assert filter_state_dict(sd, "ebc.") == out
    assert filter_state_dict(sd, "") == sd
    assert filter_state_dict(sd, "missing") == OrderedDict()


def test_add_prefix_to_state_dict_moves_keys_and_metadata():
    inner = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    sd = inner.state_dict()
    add_prefix_to_state_dict(sd, "model.")
    assert list(sd) == [f"model.{k}" for k in inner.state_dict()]
    assert sorted(sd._metadata) == ["model", "model.0", "model.1"]
    outer = nn.Module()
    outer.model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    assert not outer.load_state_dict(sd).missing_keys
    assert torch.equal(outer.model[0].weight, inner[0].weight)

    plain = {"a": 1, "b": 2}
    add_prefix_to_state_dict(plain, "p_")
    assert plain == {"p_a": 1, "p_b": 2}


def test_merge_fused_params_table_overrides_sharder():
    sharder = {"optimizer": OptimType.ADAM, "learning_rate": 0.1, "eps": 1e-6}
    table = {"lr": 0.5}
    merged = merge_fused_params(sharder, table)
    assert merged == {"optimizer": OptimType.ADAM, "lr": 0.5, "eps": 1e-6}
    assert sharder == {"optimizer": OptimType.ADAM, "learning_rate": 0.1, "eps": 1e-6}  # inputs untouched
    assert table == {"lr": 0.5}
    assert merge_fused_params() == {} and merge_fused_params(None, {"lr": 1.0}) == {"lr": 1.0}
    with pytest.raises(ValueError, match="'lr' twice"):
        merge_fused_params({"lr": 0.1, "learning_rate": 0.2})


def test_add_params_from_parameter_sharding_sets_only_given_options():
    sharding = ParameterSharding("row_wise", "fused", [0], stochastic_rounding=False, enforce_hbm=True)
    out = add_params_from_parameter_sharding({"lr": 0.1, "stochastic_rounding": True}, sharding)
    assert out == {"lr": 0.1, "stochastic_rounding": False, "enforce_hbm": True}
    assert add_params_from_parameter_sharding(None, ParameterSharding("table_wise", "dense", [0])) == {}


def test_optimizer_type_to_emb_opt_type():
    assert optimizer_type_to_emb_opt_type(torch.optim.SGD) is OptimType.SGD
    assert optimizer_type_to_emb_opt_type(torch.optim.Adagrad) is OptimType.ADAGRAD
    assert optimizer_type_to_emb_opt_type(torch.optim.Adam) is OptimType.ADAM
    assert optimizer_type_to_emb_opt_type(torch.optim.SparseAdam) is OptimType.ADAM
    assert optimizer_type_to_emb_opt_type(torch.optim.RMSprop) is None


class _HostTable(CopyableMixin):
    """Keeps its table where it is whatever the target device (like a table in host memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 2))

    def copy(self, device):
        return super().copy(self.table.device)


def test_copy_to_device_moves_only_tensors_on_the_current_device():
    model = nn.Module()
    model.dense = nn.Linear(3, 3)
    model.head = nn.Linear(3, 3)
    model.head.weight = model.dense.weight  # tied: must stay tied
    model.dense.bias.requires_grad_(False)
    model.host = _HostTable()
    model.register_buffer("meta_buf", torch.empty(2, device="meta"))
    model.names = ["dense", "head"]

    copied = copy_to_device(model, torch.device("cpu"), torch.device("meta"))
    assert copied.dense.weight.device.type == "meta" and copied.dense.bias.device.type == "meta"
    assert copied.head.weight is copied.dense.weight
    assert not copied.dense.bias.requires_grad and copied.dense.weight.requires_grad
    assert isinstance(copied.dense.weight, nn.Parameter)
    assert copied.host.table.device.type == "cpu" and torch.equal(copied.host.table, model.host.table)
    assert copied.host.table is not model.host.table
    assert copied.meta_buf.device.type == "meta"
    assert copied.names == model.names and copied.names is not model.names  # a deep copy
    assert model.dense.weight.device.type == "cpu"  # the original is untouched
    assert isinstance(copy_to_device(_HostTable(), "cpu", "meta"), _HostTable)


class _Sharded(ShardedModule):
    def create_context(self):
        return None

    def input_dist(self, ctx, *input, **kwargs):
        raise NotImplementedError

    def compute(self, ctx, dist_input):
        raise NotImplementedError

    def output_dist(self, ctx, output):
        raise NotImplementedError


def test_get_unsharded_module_names():
    model = nn.Module()
    model.dense = nn.Linear(2, 2)
    model.sparse = nn.Sequential(nn.Linear(2, 2), _Sharded())
    model.ebc = _Sharded()
    model.over = nn.Sequential(nn.ReLU())
    assert get_unsharded_module_names(model) == ["dense", "over"]


def test_permute_pooled_embeddings_is_reexported():
    assert UtilsPermute is PermutePooledEmbeddings
