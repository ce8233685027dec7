"""checkpoint.load is all or nothing: every way the optimizer part of a load can be refused is
found before anything is written, so a refused load leaves every model tensor and every optimizer
state tensor (and hyper-parameter) bitwise as it was, on every rank (issue 23 item 8).

Each case saves a checkpoint on 2 ranks (tables sharded row-, table- and column-wise, fused Adagrad,
torch Adam on the dense layer), then loads it into a model trained differently whose optimizers
cannot take it, and compares everything with a snapshot taken before the load.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from shardkit import checkpoint
from shardkit.optim import KeyedOptimizer
from shardkit.testing import run_world
from tests.checkpoint.test_checkpoint import _expect_error, _flat, _full, _trained


class _Keyed(KeyedOptimizer):
    """A KeyedOptimizer driving torch's Adam over the dense layer, in one or two param groups."""

    def __init__(self, dense: torch.nn.Linear, groups: int) -> None:
        params = {"dense.weight": dense.weight, "dense.bias": dense.bias}
        split = [{"params": [dense.weight]}, {"params": [dense.bias]}]
        self.adam = torch.optim.Adam(split if groups == 2 else list(params.values()), lr=0.01)
        super().__init__(params, self.adam.state, self.adam.param_groups)
        self.save_param_groups(True)
        self.init_state()

    def step(self, closure=None):
        return self.adam.step(closure)


class _Edited:
    """An optimizer whose saved state is ``edit(state_dict())``: writes a checkpoint that a correct
    save would not (the loader treats the record as it treats the optimizer's own)."""

    def __init__(self, optimizer, edit) -> None:
        self.optimizer, self.edit = optimizer, edit

    def state_dict(self):
        return self.edit(self.optimizer.state_dict())

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)


def _bits(value):
    """``value`` as raw bytes (a tensor) for a bitwise comparison; other values as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1).contiguous().view(torch.uint8).clone()
    return value


def _snapshot(model, optimizers: dict) -> dict:
    """Every model tensor (whole, a collective), every fused state tensor, every torch optimizer's
    state tensors and param groups' hyper-parameters."""
    out = {f"model.{k}": _bits(_full(v)) for k, v in _flat(model.state_dict()).items()}
    fused = model.ebc.fused_optimizer.state_dict()
    out.update({f"fused.{k}": _bits(_full(v)) for k, v in _flat(fused).items()})
    for key, opt in optimizers.items():
        if not isinstance(opt, torch.optim.Optimizer):
            continue
        opt = getattr(opt, "adam", opt)
        for i, state in enumerate(opt.state.values()):
            out.update({f"{key}.state{i}.{name}": _bits(v) for name, v in state.items()})
        for g, group in enumerate(opt.param_groups):
            out.update({f"{key}.group{g}.{name}": v for name, v in group.items() if name != "params"})
    return out


def _assert_unchanged(before: dict, after: dict, case: str) -> None:
    assert before.keys() == after.keys(), f"{case}: the state's keys changed"
    for key, value in before.items():
        same = torch.equal(value, after[key]) if isinstance(value, torch.Tensor) else value == after[key]
        assert same, f"rank {dist.get_rank()}, {case}: {key} was written by a refused load"


def _drop_sum(sd: dict) -> dict:
    sd = {**sd, "state": dict(sd["state"])}
    sd["state"]["t0"] = {k: v for k, v in sd["state"]["t0"].items() if k != "sum"}
    return sd


def _refused_loads_change_nothing(root: str) -> bool:
    source, adam = _trained(0, 2)
    model = source
    w, b = model.dense.weight, model.dense.bias
    adam_exp_avg = adam.state[w]["exp_avg"].clone()
    two_groups = torch.optim.Adam([{"params": [w]}, {"params": [b], "lr": 0.5}], lr=0.01)
    fused = model.ebc.fused_optimizer
    saves = {
        "one_group": {"dense": adam, "fused": fused},
        "two_groups": {"dense": two_groups, "fused": fused},
        "negative_lr": {"dense": adam, "fused": _Edited(fused, lambda sd: {**sd, "lr": -1.0})},
        "no_sum": {"dense": adam, "fused": _Edited(fused, _drop_sum)},
    }
    saves["keyed_two_groups"] = {"dense": _Keyed(model.dense, 2), "fused": fused}
    for name, optimizers in saves.items():
        checkpoint.save(os.path.join(root, name), model, optimizers)
    # Adam's exp_avg of the weight with its elements in another shape
    adam.state[w]["exp_avg"] = adam.state[w]["exp_avg"].reshape(-1).clone()
    checkpoint.save(os.path.join(root, "flat_state"), model, {"dense": adam, "fused": fused})

    def target(dense: str):
        """A model trained otherwise (every tensor differs from the checkpoints') and its optimizers:
        a fresh one per case, so that a case cannot hide a write behind an earlier one."""
        target, target_adam = _trained(1, 1)
        tw, tb = target.dense.weight, target.dense.bias
        optimizer = {
            "adam": target_adam,
            "weight_only": torch.optim.Adam([tw], lr=0.02),
            "two_groups": torch.optim.Adam([{"params": [tw]}, {"params": [tb]}], lr=0.03),
            "keyed": _Keyed(target.dense, 1),
        }[dense]
        if isinstance(optimizer, torch.optim.Adam) and optimizer is not target_adam:  # state too
            tw.grad, tb.grad = torch.ones_like(tw), torch.ones_like(tb)
            optimizer.step()
        return target, {"dense": optimizer, "fused": target.ebc.fused_optimizer}

    cases = [
        ("one_group", "two_groups", ["'dense'", "1 param groups saved, 2 here"]),
        ("two_groups", "adam", ["'dense'", "2 param groups saved, 1 here"]),
        ("one_group", "weight_only", ["does not hold", "dense.bias"]),
        ("flat_state", "adam", ["'exp_avg' of 'dense.weight'", "has shape (12,), expected (1, 12)"]),
        ("negative_lr", "adam", ["'fused'", "learning rate must be >= 0"]),
        ("no_sum", "adam", ["optim.fused.state.t0.sum"]),
        ("keyed_two_groups", "keyed", ["'dense'", "2 param groups given, 1 here"]),
    ]
    failures = []
    for name, dense, patterns in cases:
        model, optimizers = target(dense)
        before = _snapshot(model, optimizers)
        path = os.path.join(root, name)
        try:  # every case runs (and every rank takes part in each load's collectives)
            _expect_error(lambda: checkpoint.load(path, model, optimizers), *patterns)  # noqa: B023
        except (Exception, pytest.fail.Exception) as err:  # no error, or not the expected one
            failures.append(f"{name}: {type(err).__name__}: {str(err)[:300]}")
        # a collective (sharded tables): every rank compares, whatever the load did
        after = _snapshot(model, optimizers)
        try:
            _assert_unchanged(before, after, f"{name} into {dense}")
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n".join(failures)
    # and the same model and optimizers still load a checkpoint that fits
    fresh, optimizers = target("adam")
    checkpoint.load(os.path.join(root, "one_group"), fresh, optimizers)
    assert torch.equal(fresh.dense.weight, source.dense.weight)
    assert torch.equal(optimizers["dense"].state[fresh.dense.weight]["exp_avg"], adam_exp_avg)
    return True


def test_refused_optimizer_loads_change_nothing(tmp_path):
    assert run_world(_refused_loads_change_nothing, 2, str(tmp_path)) == [True, True]
