"""With the shared-memory exchange on, DMP's DDP has shardkit's all-reduce hook, and it yields: a torchrec
program's hook registered on that DDP (its own, a builtin, a fused optimizer's) is the one called and
the gradients are what that hook gives; a second one is DDP's own error; ``shm_allreduce=False`` leaves
DDP's hook slot empty."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from shardkit.distributed import shm_exchange
from shardkit.model_parallel import data_parallel
from tests.model_parallel import _dlrm as d

STEPS = 3


def _counting_hook(state, bucket):
    """DDP's all-reduce (gloo) that counts its buckets in ``state["calls"]``."""
    state["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def _train(shm_allreduce: bool, register=None, dense_step: bool = True) -> dict:
    """A row-wise DLRM through DMP for STEPS steps; ``register(ddp)`` runs once DMP is built."""
    dmp = d.row_wise_dmp(data_parallel.DefaultDataParallelWrapper(shm_allreduce=shm_allreduce))
    ddp = dmp._dmp_wrapped_module
    shm_states = [s for _, s in ddp._comm_hooks]  # shardkit's default, if any, before the caller's
    shm_states = [getattr(s, "state", s) for s in shm_states]
    shm_states = [s for s in shm_states if isinstance(s, data_parallel.ShmAllReduceState)]
    extra = register(ddp) if register is not None else None
    params = d.train_dense_sgd(dmp, STEPS, dense_step)
    return {
        "params": {n: p.detach().clone() for n, p in params.items()},
        "grads": {n: p.grad.clone() for n, p in params.items() if p.grad is not None},
        "shm_calls": [s.calls for s in shm_states],
        "hooks_after": len(ddp._comm_hooks),
        "extra": extra,
    }


def _register_user(ddp) -> dict:
    state = {"calls": 0}
    ddp.register_comm_hook(state, _counting_hook)
    return state


def _register_builtin(kind: str):
    def register(ddp) -> None:
        ddp._register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, kind))

    return register


def _hook_case(case: str) -> dict:
    shm_exchange.set_shm_exchange(True)
    try:
        if case == "user":
            got = _train(True, _register_user)
            ref = _train(False)
        elif case in ("ALLREDUCE", "FP16_COMPRESS"):
            got = _train(True, _register_builtin(case))
            ref = _train(False, _register_builtin(case))  # DDP's own C++ builtin hook
        elif case == "fused_optim":  # the optimizer steps inside backward: no dense step here
            got = _train(True, lambda ddp: ddp._register_fused_optim(torch.optim.SGD, d.LR), False)
            ref = _train(False)
        return {"got": got, "ref": ref}
    finally:
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()


def _assert_same(got: dict, ref: dict) -> None:
    assert got["params"].keys() == ref["params"].keys() and got["params"]
    for name in got["params"]:
        assert torch.equal(got["params"][name], ref["params"][name]), name
    assert got["grads"].keys() == ref["grads"].keys()
    for name in got["grads"]:
        assert torch.equal(got["grads"][name], ref["grads"][name]), name


def test_a_user_hook_on_dmps_ddp_replaces_the_shared_memory_hook(run_world):
    for result in run_world(_hook_case, 2, "user"):
        got, ref = result["got"], result["ref"]
        assert got["extra"] == {"calls": STEPS}  # one bucket per step, all through the user's hook
        assert got["shm_calls"] == [0]  # shardkit's hook was installed, and never called
        _assert_same(got, ref)  # gloo's all-reduce either way: the same bits


@pytest.mark.parametrize("kind", ["ALLREDUCE", "FP16_COMPRESS"])
def test_a_builtin_hook_on_dmps_ddp_keeps_its_meaning(run_world, kind):
    for result in run_world(_hook_case, 2, kind):
        got, ref = result["got"], result["ref"]
        assert got["shm_calls"] == [0]
        _assert_same(got, ref)  # the Python equivalent gives the C++ builtin's bits


def test_a_fused_optimizer_registered_on_dmps_ddp_steps_in_backward(run_world):
    for result in run_world(_hook_case, 2, "fused_optim"):
        got, ref = result["got"], result["ref"]
        assert got["shm_calls"] == [0]
        for name in ref["params"]:
            torch.testing.assert_close(got["params"][name], ref["params"][name], rtol=0, atol=1e-7)


def _second_hook(first: str) -> list:
    shm_exchange.set_shm_exchange(True)
    try:
        errors = []
        for second in ("user", "builtin"):

            def register(ddp, second=second) -> None:
                if first == "user":
                    ddp.register_comm_hook({"calls": 0}, _counting_hook)
                else:
                    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
                try:
                    if second == "user":
                        ddp.register_comm_hook({"calls": 0}, _counting_hook)
                    else:
                        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
                except RuntimeError as err:
                    errors.append(str(err))
                else:
                    errors.append(None)

            _train(True, register)
        return errors
    finally:
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()


@pytest.mark.parametrize("first", ["user", "builtin"])
def test_a_second_hook_is_ddps_own_error(run_world, first):
    for errors in run_world(_second_hook, 2, first):
        assert len(errors) == 2
        for message in errors:
            assert message is not None and "can only be called once" in message, errors


def _without_shm_allreduce() -> dict:
    shm_exchange.set_shm_exchange(True)
    try:
        return _train(False, lambda ddp: [len(ddp._comm_hooks), _register_user(ddp)])
    finally:
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()


def test_shm_allreduce_false_leaves_ddps_hook_slot_empty(run_world):
    for result in run_world(_without_shm_allreduce, 2):
        hooks_at_build, state = result["extra"]
        assert hooks_at_build == 0 and result["shm_calls"] == []
        assert state == {"calls": STEPS} and result["hooks_after"] == 1  # DDP's own registration
