"""KeyedOptimizer / OptimizerWrapper: state dicts keyed by parameter name, loaded in place."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard import sharded_tensor, sharding_spec

from shardkit.optim import KeyedOptimizer, OptimizerWrapper
from shardkit.testing import run_world


class _Sgd(KeyedOptimizer):
    """A KeyedOptimizer driving torch's SGD (the way a subclass adds a step)."""

    def __init__(self, params):
        self.sgd = torch.optim.SGD(list(params.values()), lr=0.5, momentum=0.9)
        super().__init__(params, self.sgd.state, self.sgd.param_groups)

    def step(self, closure=None):
        return self.sgd.step(closure)


def _params():
    return {"w": torch.nn.Parameter(torch.ones(2)), "b": torch.nn.Parameter(torch.zeros(3))}


def test_state_dict_names_parameters_and_groups_only_when_asked():
    params = _params()
    opt = _Sgd(params)
    assert isinstance(opt, torch.optim.Optimizer)  # LR schedulers accept it
    opt.init_state()  # one step on zero gradients creates the momentum buffers
    assert set(opt.state_dict()) == {"state"}
    assert set(opt.state_dict()["state"]) == {"w", "b"}
    opt.save_param_groups(True)
    (group,) = opt.state_dict()["param_groups"]
    assert group["params"] == ["w", "b"] and group["lr"] == 0.5
    torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1).step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_load_writes_tensors_in_place_and_groups_by_name():
    src, dst = _Sgd(_params()), _Sgd(_params())
    for opt in (src, dst):
        opt.init_state()
        opt.save_param_groups(True)
    src.state[src.params["w"]]["momentum_buffer"].fill_(3.0)
    src.param_groups[0]["lr"] = 0.25
    buffer = dst.state[dst.params["w"]]["momentum_buffer"]
    dst.load_state_dict(src.state_dict())
    assert buffer is dst.state[dst.params["w"]]["momentum_buffer"]  # same storage, new contents
    assert buffer.tolist() == [3.0, 3.0] and dst.param_groups[0]["lr"] == 0.25
    with pytest.raises(KeyError, match="no state for parameter 'b'"):
        dst.load_state_dict({"state": {"w": src.state_dict()["state"]["w"]}})


def test_refused_load_writes_nothing():
    """A state dict refused for its last parameter or its groups leaves every state tensor and
    hyper-parameter as it was (checkpoint.load relies on it: issue 23 item 8)."""
    src, dst = _Sgd(_params()), _Sgd(_params())
    for opt in (src, dst):
        opt.init_state()
        opt.save_param_groups(True)
    src.state[src.params["w"]]["momentum_buffer"].fill_(3.0)
    src.param_groups[0]["lr"] = 0.25

    def unchanged():
        return (
            dst.state[dst.params["w"]]["momentum_buffer"].tolist() == [0.0, 0.0]
            and dst.param_groups[0]["lr"] == 0.5
        )

    wrong_shape = src.state_dict()
    wrong_shape["state"]["b"] = {"momentum_buffer": torch.ones(4)}
    with pytest.raises(ValueError, match=r"b.momentum_buffer has shape \(4,\), \(3,\) here"):
        dst.load_state_dict(wrong_shape)
    assert unchanged()
    assert dst.check_state_dict(wrong_shape) and OptimizerWrapper(dst).check_state_dict(wrong_shape)
    other_groups = src.state_dict()
    other_groups["param_groups"] = [{**other_groups["param_groups"][0], "params": ["w"]}]
    with pytest.raises(ValueError, match=r"param group 0 holds \['w', 'b'\]"):
        dst.load_state_dict(other_groups)
    assert unchanged()
    assert dst.check_state_dict(src.state_dict()) == []


def test_state_keys_must_be_parameters_and_groups_are_fixed():
    p = torch.nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match="All state keys must be params."):
        KeyedOptimizer({"p": p}, {p: {}, "other": {}}, [{"params": [p]}])
    opt = KeyedOptimizer({"p": p}, {}, [{"params": [p]}])
    with pytest.raises(NotImplementedError, match="fixed at construction"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})


def test_wrapper_forwards_state_steps_and_state_dicts():
    inner = _Sgd(_params())
    wrapper = OptimizerWrapper(inner)
    wrapper.params["w"].grad = torch.ones(2)
    wrapper.params["b"].grad = torch.zeros(3)
    wrapper.step()
    assert wrapper.params["w"].tolist() == [0.5, 0.5]
    wrapper.save_param_groups(True)
    sd = wrapper.state_dict()
    sd["param_groups"][0]["lr"] = 0.125
    wrapper.load_state_dict(sd)
    assert inner.param_groups[0]["lr"] == wrapper.param_groups[0]["lr"] == 0.125
    assert wrapper.state is inner.state
    wrapper.zero_grad()
    assert wrapper.params["w"].grad is None


def _sharded_state_round_trip():
    # a ShardedTensor in the state is loaded shard by shard, in place
    spec = sharding_spec.ChunkShardingSpec(
        dim=0, placements=[f"rank:{r}/cpu" for r in range(dist.get_world_size())]
    )
    p = torch.nn.Parameter(torch.ones(2))
    held = sharded_tensor.full(spec, (4,), fill_value=1.0)
    opt = KeyedOptimizer({"p": p}, {p: {"sum": held, "step": 1}}, [{"params": [p]}])
    new = sharded_tensor.full(spec, (4,), fill_value=7.0)
    opt.load_state_dict({"state": {"p": {"sum": new, "step": 5}}})
    loaded = opt.state_dict()["state"]["p"]
    return loaded["sum"] is held, loaded["sum"].local_shards()[0].tensor.tolist(), loaded["step"]


def test_sharded_state_is_copied_shard_by_shard():
    for same, values, step in run_world(_sharded_state_round_trip, 2):
        assert same and values == [7.0, 7.0] and step == 5
