from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed.awaitable import (
    Awaitable,
    GetItemLazyAwaitable,
    LazyAwaitable,
    LazyGetItemMixin,
    LazyNoWait,
    NoWait,
)
from shardkit.testing import run_world


class _Counting(LazyAwaitable):
    """A lazy awaitable that counts how often its work is completed."""

    def __init__(self, value):
        super().__init__()
        self.value = value
        self.waits = 0

    def _wait_impl(self):
        self.waits += 1
        return self.value


class _Raw(Awaitable):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def _wait_impl(self):
        return self.value


# ---------------------------------------------------------------- Awaitable, NoWait


def test_awaitable_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        Awaitable()


def test_callbacks_transform_the_result_in_order():
    aw = _Raw(3)
    aw.callbacks.append(lambda x: x + 1)
    aw.callbacks.append(lambda x: x * 2)
    assert aw.wait() == 8
    assert NoWait("x").wait() == "x"
    no_wait = NoWait([1])
    no_wait.callbacks.append(lambda x: x + [2])
    assert no_wait.wait() == [1, 2]


def test_a_wait_is_a_named_range_while_a_profiler_runs():
    # the range is entered only while a profiler runs (it costs an op dispatch each way otherwise)
    aw = _Raw(3)
    aw.callbacks.append(lambda x: x + 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert aw.wait() == 4
    names = [event.name for event in prof.events()]
    assert "## _Raw wait() ##" in names
    assert _Raw(5).wait() == 5  # and without one, the same result


# ---------------------------------------------------------------- LazyAwaitable, single process


def test_nothing_waits_until_the_result_is_used():
    lazy = _Counting(torch.arange(3.0))
    lazy.callbacks.append(lambda t: t * 10)
    assert repr(lazy) == "_Counting(pending)"
    assert hash(lazy) == object.__hash__(lazy)  # identity hash, no wait
    assert lazy.waits == 0 and not lazy.is_waited
    assert torch.equal(torch.add(lazy, 1), torch.tensor([1.0, 11.0, 21.0]))
    assert lazy.waits == 1 and lazy.is_waited
    # every later use, and wait() itself, reuses the result: no second wait, no second callback
    assert lazy.sum().item() == 30.0
    assert torch.equal(lazy.wait(), torch.tensor([0.0, 10.0, 20.0]))
    assert lazy.wait() is lazy.wait()
    assert lazy.waits == 1
    assert repr(lazy) == "_Counting(waited: Tensor)"


def test_torch_functions_wait_for_nested_and_keyword_arguments():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    assert torch.equal(torch.cat([_Counting(a), b]), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(torch.stack((a, _Counting(b))), torch.stack((a, b)))
    assert torch.equal(torch.add(a, other=_Counting(b)), a + b)
    assert torch.equal(torch.where(_Counting(a) > 1, _Counting(b), a), torch.tensor([1.0, 4.0]))
    # a tensor method with a lazy argument dispatches through __torch_function__ too
    assert torch.equal(a + _Counting(b), a + b)
    assert torch.equal(a.mul(_Counting(b)), a * b)
    # a module's forward never sees the awaitable
    linear = torch.nn.Linear(2, 1)
    assert torch.equal(linear(_Counting(a)), linear(a))


def test_nested_containers_are_resolved_without_copying_plain_ones():
    from shardkit.distributed.awaitable import _resolve

    size = torch.Size([2, 3])
    assert _resolve(size) is size
    nested = {"x": [1, (LazyNoWait(2), {"y": LazyNoWait(3)})], "s": size}
    assert _resolve(nested) == {"x": [1, (2, {"y": 3})], "s": size}


_T = torch.tensor([1.0, 2.0, 3.0])


@pytest.mark.parametrize(
    "use, expected",
    [
        (lambda x: x + 1, 8),
        (lambda x: 1 + x, 8),
        (lambda x: x - 1, 6),
        (lambda x: 10 - x, 3),
        (lambda x: x * 2, 14),
        (lambda x: 2 * x, 14),
        (lambda x: x / 2, 3.5),
        (lambda x: 14 / x, 2.0),
        (lambda x: x // 2, 3),
        (lambda x: 15 // x, 2),
        (lambda x: x % 4, 3),
        (lambda x: 9 % x, 2),
        (lambda x: divmod(x, 2), (3, 1)),
        (lambda x: divmod(15, x), (2, 1)),
        (lambda x: x**2, 49),
        (lambda x: 2**x, 128),
        (lambda x: x << 1, 14),
        (lambda x: 1 << x, 128),
        (lambda x: x >> 1, 3),
        (lambda x: x & 3, 3),
        (lambda x: 4 | x, 7),
        (lambda x: x ^ 1, 6),
        (lambda x: -x, -7),
        (lambda x: +x, 7),
        (lambda x: abs(x), 7),
        (lambda x: ~x, -8),
        (lambda x: x < 8, True),
        (lambda x: x <= 6, False),
        (lambda x: x == 7, True),
        (lambda x: x != 7, False),
        (lambda x: x > 7, False),
        (lambda x: x >= 7, True),
        (lambda x: 8 > x, True),
        (lambda x: bool(x), True),
        (lambda x: float(x), 7.0),
        (lambda x: int(x), 7),
        (lambda x: list(range(10))[x], 7),  # __index__
        (lambda x: f"{x:03d}", "007"),
        (lambda x: str(x), "7"),
        (lambda x: x.bit_length(), 3),
        (lambda x: round(x, -1), 10),
    ],
)
def test_python_operators_on_a_number(use, expected):
    lazy = _Counting(7)
    assert use(lazy) == expected
    assert lazy.waits == 1


@pytest.mark.parametrize(
    "use, expected",
    [
        (lambda x: len(x), 3),
        (lambda x: [v.item() for v in x], [1.0, 2.0, 3.0]),
        (lambda x: [v.item() for v in reversed(x)], [3.0, 2.0, 1.0]),
        (lambda x: x[1].item(), 2.0),
        (lambda x: x[1:].tolist(), [2.0, 3.0]),
        (lambda x: (x @ _T).item(), 14.0),
        (lambda x: (_T @ x).item(), 14.0),
        (lambda x: (x * _T).tolist(), [1.0, 4.0, 9.0]),
        (lambda x: (_T - x).tolist(), [0.0, 0.0, 0.0]),
        (lambda x: (x > 1).tolist(), [False, True, True]),
        (lambda x: tuple(x.shape), (3,)),
        (lambda x: x.dtype, torch.float32),
    ],
)
def test_python_operators_and_attributes_on_a_tensor(use, expected):
    lazy = _Counting(_T.clone())
    assert use(lazy) == expected
    assert lazy.waits == 1


def test_container_operators():
    lazy = _Counting({"a": 1})
    assert "a" in lazy and "b" not in lazy
    lazy["b"] = 2
    del lazy["a"]
    assert lazy.wait() == {"b": 2} and lazy.keys() == {"b"}
    assert lazy.waits == 1


def test_lazy_operands_on_both_sides():
    assert _Counting(2) + _Counting(3) == 5
    assert torch.equal(_Counting(_T) * _Counting(_T), _T * _T)


def test_a_none_result_is_cached_too():
    lazy = _Counting(None)
    assert lazy.wait() is None and lazy.wait() is None
    assert lazy.waits == 1


def test_a_failed_wait_is_not_cached():
    class Flaky(LazyAwaitable):
        def __init__(self):
            super().__init__()
            self.attempts = 0

        def _wait_impl(self):
            self.attempts += 1
            if self.attempts == 1:
                raise RuntimeError("transient")
            return 5

    lazy = Flaky()
    with pytest.raises(RuntimeError, match="transient"):
        lazy + 1
    assert lazy + 1 == 6 and lazy.attempts == 2


def test_protocol_probes_and_copies_do_not_wait():
    lazy = _Counting(torch.ones(2))
    assert not hasattr(lazy, "__array_interface__")
    clone = copy.deepcopy(lazy)
    assert lazy.waits == 0 and not clone.is_waited
    assert torch.equal(clone + 0, torch.ones(2))
    assert lazy.waits == 0


def test_missing_attribute_of_the_result_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_thing"):
        _ = _Counting(torch.ones(1)).no_such_thing


def test_subclass_that_skips_init_gets_a_clear_error():
    class Broken(LazyAwaitable):
        def __init__(self):
            pass

        def _wait_impl(self):
            return 1

    with pytest.raises(RuntimeError, match=r"not been initialized properly .*call super\(\).__init__\(\)"):
        Broken() + 1


def test_missing_attribute_inside_wait_impl_is_an_error_not_a_recursion():
    class Typo(LazyAwaitable):
        def _wait_impl(self):
            return self.valeu

    with pytest.raises(AttributeError, match=r"'valeu' \(looked up while waiting\)"):
        Typo() * 2


def test_lazy_no_wait_and_generic_subscripts():
    lazy = LazyNoWait[torch.Tensor](torch.tensor([2.0]))
    assert isinstance(lazy, LazyAwaitable) and isinstance(lazy, Awaitable)
    assert torch.equal(torch.neg(lazy), torch.tensor([-2.0]))
    assert operator.index(LazyNoWait(3)) == 3


def test_result_attribute_is_none_until_waited_and_does_not_wait():
    lazy = _Counting(torch.tensor([1.0, 2.0]))
    assert lazy._result is None and lazy.waits == 0
    assert lazy.numel() == 2
    assert torch.equal(lazy._result, torch.tensor([1.0, 2.0])) and lazy.waits == 1


class _Mapping(LazyGetItemMixin[str, torch.Tensor], _Counting):
    """A lazy dict whose items are lazy too."""


def test_items_of_a_get_item_mixin_are_lazy_and_share_one_wait():
    parent = _Mapping({"a": torch.tensor(2.0), "b": torch.tensor(5.0)})
    a, b = parent["a"], parent["b"]
    assert isinstance(a, GetItemLazyAwaitable) and a._result is None and parent.waits == 0
    assert torch.add(a, b).item() == 7.0
    assert parent.waits == 1 and a.is_waited and b.is_waited
    with pytest.raises(KeyError):
        parent["c"].wait()


class _PlusEight(LazyAwaitable):
    def __init__(self, x):
        super().__init__()
        self.x = x

    def _wait_impl(self):
        return self.x + 8


class _AsyncModel(torch.nn.Module):
    def forward(self, x):
        first, second = _PlusEight(x), _PlusEight(x * 2)
        # reflected and plain operators, a torch function and an attribute, on lazy operands
        return 2 * first + x - second + torch.mul(first, 1.0) + first.numel()


def test_fx_traces_a_module_that_builds_lazy_awaitables():
    model = _AsyncModel()
    x = torch.arange(6.0).reshape(2, 3)
    traced = torch.fx.symbolic_trace(model)
    # the construction is one node of the graph, run (and waited for) when the traced module runs
    assert any(node.target is _PlusEight for node in traced.graph.nodes)
    assert torch.equal(traced(x), model(x))


# ---------------------------------------------------------------- overlap with communication


class _AllReduce(LazyAwaitable):
    """Starts an async all-reduce; completes it only when the result is first used."""

    def __init__(self, tensor, group=None):
        super().__init__()
        self.tensor = tensor
        self.work = dist.all_reduce(tensor, async_op=True, group=group)
        self.waits = 0

    def _wait_impl(self):
        self.waits += 1
        self.work.wait()
        return self.tensor


def _overlap():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    pending = _AllReduce(torch.full((3,), float(rank + 1)))
    pending.callbacks.append(lambda t: t / world)  # mean instead of sum, applied at wait time
    # while the all-reduce is in flight: local compute and another collective proceed
    local = torch.arange(3.0) * 2
    other = torch.tensor([1.0])
    dist.all_reduce(other)
    out["before_use"] = (pending.waits, pending.is_waited, other.item())
    # the model uses the awaitable as if it were a tensor: this is where it waits, once
    mixed = torch.add(local, pending)
    out["after_use"] = (pending.waits, mixed.tolist())
    out["again"] = ((pending * 2).tolist(), pending.shape, pending.waits)

    # two in flight, consumed by one torch call
    first = _AllReduce(torch.tensor([float(rank)]))
    second = _AllReduce(torch.tensor([1.0]))
    out["pair_before"] = (first.waits, second.waits)
    out["pair"] = (torch.cat([first, second]).tolist(), first.waits, second.waits)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_lazy_all_reduce_overlaps_until_used(world_size):
    n = world_size
    mean = (n + 1) / 2
    for out in run_world(_overlap, world_size):
        assert out["before_use"] == (0, False, float(n))
        assert out["after_use"] == (1, [mean, 2 + mean, 4 + mean])
        assert out["again"] == ([2 * mean] * 3, torch.Size([3]), 1)
        assert out["pair_before"] == (0, 0)
        assert out["pair"] == ([n * (n - 1) / 2, float(n)], 1, 1)
