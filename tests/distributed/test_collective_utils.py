from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed.collective_utils import (
    RemoteInvocationError,
    all_reduce_sum_scalar,
    invoke_on_rank_and_broadcast_result,
    is_leader,
    run_on_leader,
)
from shardkit.testing import run_world

# ---------------------------------------------------------------- single process


def test_is_leader_without_group_is_the_only_process():
    assert is_leader(None)
    assert is_leader(None, leader_rank=0)
    assert not is_leader(None, leader_rank=1)


def test_invoke_without_distributed_is_a_plain_call():
    assert not dist.is_initialized()
    assert invoke_on_rank_and_broadcast_result(None, 0, lambda a, b=0: a + b, 1, b=2) == 3
    with pytest.raises(ValueError, match="invoking rank 1 is out of range for a process group of size 1"):
        invoke_on_rank_and_broadcast_result(None, 1, int)
    assert run_on_leader(None, 0)(lambda: "ok")() == "ok"


@pytest.mark.parametrize(
    "value, expected",
    [
        (3, 3.0),
        (2.5, 2.5),
        (True, 1.0),
        (torch.tensor(7, dtype=torch.int64), 7.0),
        (torch.tensor([1.5], dtype=torch.bfloat16), 1.5),
        (torch.tensor([[4]], dtype=torch.int32), 4.0),
        (torch.tensor(0.25, dtype=torch.float64), 0.25),
    ],
)
def test_scalar_sum_without_distributed_is_a_fresh_fp32_copy(value, expected):
    before = value.clone() if isinstance(value, torch.Tensor) else value
    out = all_reduce_sum_scalar(value)
    assert out.dtype == torch.float32 and out.dim() == 0 and out.item() == expected
    if isinstance(value, torch.Tensor):
        assert value.dtype == before.dtype and torch.equal(value, before)


def test_scalar_sum_never_aliases_an_fp32_input():
    value = torch.tensor(2.0, requires_grad=True)
    out = all_reduce_sum_scalar(value)
    assert out.data_ptr() != value.data_ptr() and not out.requires_grad
    out.add_(1)
    assert value.item() == 2.0


@pytest.mark.parametrize(
    "value, match",
    [
        (torch.ones(2), r"expected a scalar, got a tensor of shape \(2,\)"),
        (torch.ones(0), r"got a tensor of shape \(0,\)"),
        (torch.tensor(1j), "expected a real scalar, got a tensor of dtype torch.complex"),
        ("1", "got str"),
        (None, "got NoneType"),
        (10**400, "does not fit in fp32"),
    ],
)
def test_scalar_sum_rejects_non_scalars(value, match):
    with pytest.raises(ValueError, match=match):
        all_reduce_sum_scalar(value)


# ---------------------------------------------------------------- multi-rank


def _record(calls: list, x, *, scale=1):
    calls.append(x)
    return {"ran_on": dist.get_rank(), "x": x * scale}


def _explode(message):
    raise KeyError(message)


def _unpicklable():
    return lambda: None


def _invocations():
    rank, world = dist.get_rank(), dist.get_world_size()
    last = world - 1
    out = {"leader": (is_leader(dist.group.WORLD), is_leader(dist.group.WORLD, leader_rank=last))}

    calls: list = []
    out["invoke"] = invoke_on_rank_and_broadcast_result(None, last, _record, calls, 3, scale=2)
    out["calls"] = len(calls)  # only the invoking rank ran the function

    decorated = run_on_leader(dist.group.WORLD, 0)(_record)
    out["decorated"] = (decorated.__name__, decorated([], "a"))

    # the function raises on the invoking rank: an error on every rank, not a hang
    with pytest.raises((KeyError, RemoteInvocationError)) as info:
        invoke_on_rank_and_broadcast_result(dist.group.WORLD, last, _explode, f"boom {last}")
    err = info.value
    remote = isinstance(err, RemoteInvocationError)
    out["raised"] = (type(err).__name__, str(err).splitlines()[0], err.exc_type if remote else None)

    if world > 1:  # a single rank needs no pickling: it gets the object itself
        with pytest.raises(
            (TypeError, RemoteInvocationError), match="cannot be pickled for broadcast"
        ) as info:
            invoke_on_rank_and_broadcast_result(dist.group.WORLD, 0, _unpicklable)
        out["unpicklable"] = type(info.value).__name__

    with pytest.raises(ValueError, match=f"invoking rank {world} is out of range"):
        invoke_on_rank_and_broadcast_result(None, world, _record, [], 1)

    if world >= 3:
        # in a subgroup, `rank` is a rank within the group: group rank 1 is global rank world - 1
        members = [0, last]
        sub = dist.new_group(members)
        if rank in members:
            out["sub"] = invoke_on_rank_and_broadcast_result(sub, 1, _record, [], "s")
            out["sub_leader"] = is_leader(sub, 1)
        else:
            with pytest.raises(ValueError, match="is not a member"):
                invoke_on_rank_and_broadcast_result(sub, 0, _record, [], "s")

    # the group is still usable after the failures
    check = torch.ones(1)
    dist.all_reduce(check)
    out["after"] = check.item()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_invoke_on_rank_and_broadcast_result(world_size):
    results = run_world(_invocations, world_size)
    last = world_size - 1
    for rank, out in enumerate(results):
        assert out["leader"] == (rank == 0, rank == last)
        assert out["invoke"] == {"ran_on": last, "x": 6}
        assert out["calls"] == (1 if rank == last else 0)
        assert out["decorated"] == ("_record", {"ran_on": 0, "x": "a"})
        if rank == last:  # the invoking rank re-raises the original exception
            assert out["raised"] == ("KeyError", f"'boom {last}'", None)
        else:
            assert out["raised"] == (
                "RemoteInvocationError",
                f"_explode raised KeyError on rank {last}: 'boom {last}'",
                "KeyError",
            )
        if world_size >= 3 and rank in (0, last):
            assert out["sub"] == {"ran_on": last, "x": "s"}
            assert out["sub_leader"] == (rank == last)
        if world_size > 1:
            assert out["unpicklable"] == ("TypeError" if rank == 0 else "RemoteInvocationError")
        assert out["after"] == world_size


def _scalar_sums():
    rank = dist.get_rank()
    out = {}
    bf16 = torch.tensor(rank + 0.5, dtype=torch.bfloat16)
    ints = torch.tensor([rank + 1], dtype=torch.int32)
    fp32 = torch.tensor(float(rank))
    inputs = {"bf16": bf16, "int": ints, "fp32": fp32, "python": rank * 2}
    before = {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    for name, value in inputs.items():
        result = all_reduce_sum_scalar(value)
        out[name] = (result.dtype, result.dim(), result.item(), result.data_ptr() != fp32.data_ptr())
    out["unchanged"] = all(
        torch.equal(inputs[k], v) and inputs[k].dtype == v.dtype for k, v in before.items()
    )
    out["unchecked"] = all_reduce_sum_scalar(1, check=False).item()

    # a bad value on one rank is an error on every rank
    with pytest.raises(ValueError) as info:
        all_reduce_sum_scalar(torch.ones(3) if rank == 0 else 1.0)
    out["bad"] = str(info.value)

    if dist.get_world_size() >= 3:
        sub = dist.new_group([1, 2])
        if rank in (1, 2):
            out["sub"] = all_reduce_sum_scalar(rank, group=sub).item()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_reduce_sum_scalar(world_size):
    results = run_world(_scalar_sums, world_size)
    n = world_size
    for rank, out in enumerate(results):
        assert out["bf16"] == (torch.float32, 0, n * n / 2, True)
        assert out["int"] == (torch.float32, 0, n * (n + 1) / 2, True)
        assert out["fp32"] == (torch.float32, 0, n * (n - 1) / 2, True)
        assert out["python"] == (torch.float32, 0, n * (n - 1), True)
        assert out["unchanged"]
        assert out["unchecked"] == n
        if rank == 0:
            assert (
                out["bad"] == "all_reduce_sum_scalar on rank 0: expected a scalar, got a tensor of shape (3,)"
            )
        else:
            assert (
                out["bad"]
                == f"all_reduce_sum_scalar: 1 of {n} ranks passed a value that is not a real scalar"
            )
        if world_size >= 3 and rank in (1, 2):
            assert out["sub"] == 3.0
