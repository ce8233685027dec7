"""The autograd machinery shared by every comm op: a ``Request`` awaitable and two linked Functions.

Asynchronous in both directions, the way torchrec's comm ops are:

- the op calls ``_Start.apply(exchange, *inputs)``: its forward starts the collective and returns an
  empty "dummy" tensor that links the graph;
- ``request.wait()`` calls ``_Wait.apply(exchange, dummy)``: its forward waits and assembles the
  output.

In backward, ``_Wait.backward`` starts the dual collective with the output gradients and returns at
once, so that autograd runs other backward work while the gradients travel; ``_Start.backward``,
reached next along the dummy, waits for them and returns the input gradients (divided by the world
size when gradient division is on). Both backwards are ``once_differentiable``: a double backward
through an asynchronous exchange is not supported (embedding lookups, the users of these ops, have
no second derivative).

An op's specifics live in a ``CommPlan``: its info, how to start the forward exchange and how to
start the backward one. The ``_Exchange`` carries the plan and the exchange in flight between the
request and the two Functions.
"""

from __future__ import annotations

import abc
from typing import Any, Optional, TypeVar, Union

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from shardkit.distributed.awaitable import Awaitable
from shardkit.distributed.comm_ops.exchange import Pending
from shardkit.distributed.state import register_reset

W = TypeVar("W")
Outputs = Union[torch.Tensor, tuple[torch.Tensor, ...]]

# torchrec's default: gradients of a comm op are divided by the world size, which makes data-parallel
# style training over the group match a single process on the global batch with a mean loss.
_GRADIENT_DIVISION = [True]


def set_gradient_division(val: bool) -> None:
    """Whether the backward of the comm ops divides gradients by the group's world size (default True).

    Read when an op is called: a forward/backward pair uses the setting of its forward.
    """
    if not isinstance(val, bool):
        raise TypeError(f"set_gradient_division expects a bool, got {type(val).__name__}")
    _GRADIENT_DIVISION[0] = val


def get_gradient_division() -> bool:
    """The current gradient-division setting (see ``set_gradient_division``)."""
    return _GRADIENT_DIVISION[0]


def _reset_gradient_division() -> None:
    _GRADIENT_DIVISION[0] = True


# a long-lived test worker must not carry one task's setting into the next
register_reset("comm_ops.gradient_division", _reset_gradient_division)


class CommPlan(abc.ABC):
    """One call of a comm op: the forward exchange of its inputs and the backward exchange of its gradients.

    ``world`` is the group size; ``info`` the op's info dataclass; ``divide`` the gradient-division
    setting when the op was called.
    """

    def __init__(self, world: int, info: Any) -> None:
        self.world = world
        self.info = info
        self.divide = get_gradient_division()

    @abc.abstractmethod
    def start_forward(self, inputs: tuple[torch.Tensor, ...]) -> Pending[Outputs]:
        """Start the forward collective; the pending result is the op's output (a tensor or a tuple)."""

    @abc.abstractmethod
    def start_backward(self, grads: tuple[torch.Tensor, ...]) -> Pending[tuple[torch.Tensor, ...]]:
        """Start the dual collective on the output gradients; the pending result is one gradient per input."""


class _Exchange:
    """The plan of one op call and its exchange in flight, shared by the request and both Functions.

    Kept apart from the ``Request`` so that the autograd graph (which holds it through the Functions'
    contexts) never refers back to the request, which holds the graph's output: no reference cycle
    through autograd's C++ nodes, which Python's garbage collector cannot see.
    """

    def __init__(self, plan: CommPlan) -> None:
        self.plan = plan
        self.pending: Optional[Pending] = None


class Request(Awaitable[W]):
    """The awaitable result of a comm op on ``pg``: ``wait()`` completes the exchange and returns the output.

    Waiting a second time returns the same result (the exchange happens once).
    """

    def __init__(self, pg: Optional[dist.ProcessGroup], device: torch.device) -> None:
        super().__init__()
        self.pg = pg
        self.device = device
        self._exchange: Optional[_Exchange] = None
        self._dummy: Optional[torch.Tensor] = None
        self._as_list = False
        self._result: Optional[W] = None

    @property
    def info(self) -> Any:
        """The op's info dataclass (``All2AllPooledInfo``, ...), with the sizes the op filled in."""
        return self._exchange.plan.info

    def _wait_impl(self) -> W:
        if self._result is None:
            outputs = _Wait.apply(self._exchange, self._dummy)
            self._dummy = None  # the graph keeps what it needs
            self._result = list(outputs) if self._as_list else outputs
        return self._result


def start_request(
    plan: CommPlan,
    pg: Optional[dist.ProcessGroup],
    inputs: tuple[torch.Tensor, ...],
    as_list: bool = False,
) -> Request:
    """Start ``plan`` on ``inputs`` and return its ``Request`` (its result a list when ``as_list``)."""
    request: Request = Request(pg, inputs[0].device)
    request._exchange = _Exchange(plan)
    request._as_list = as_list
    request._dummy = _Start.apply(request._exchange, *inputs)
    return request


class _Start(torch.autograd.Function):
    """Forward: start the plan's exchange, return the dummy. Backward: wait for the input gradients.

    Saved for backward: the exchange (its plan holds the sizes, its pending the gradient exchange).
    """

    @staticmethod
    def forward(ctx, exchange: _Exchange, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.exchange = exchange
        exchange.pending = exchange.plan.start_forward(inputs)
        return inputs[0].new_empty(0)

    @staticmethod
    @once_differentiable
    def backward(ctx, _dummy_grad: torch.Tensor):
        exchange = ctx.exchange
        pending = exchange.pending
        grads = pending.wait()
        exchange.pending = None
        plan = exchange.plan
        if plan.divide and plan.world > 1 and not pending.divided:
            # in place: every backward exchange returns buffers of its own (receive buffers, or
            # views of them), so dividing them saves a pass into a new [B, D] tensor
            grads = tuple(grad.div_(plan.world) for grad in grads)
        return (None, *grads)


class _Wait(torch.autograd.Function):
    """Forward: wait for the exchange, return the output. Backward: start the dual exchange.

    Saved for backward: the exchange.
    """

    @staticmethod
    def forward(ctx, exchange: _Exchange, dummy: torch.Tensor) -> Outputs:
        ctx.exchange = exchange
        ctx.dummy_meta = (dummy.dtype, dummy.device)
        outputs = exchange.pending.wait()
        exchange.pending = None
        # outputs are often views of the receive buffer, which nothing else holds; autograd forbids
        # in-place changes to views made inside a Function, and detach() drops the view relation
        if isinstance(outputs, tuple):
            return tuple(output.detach() for output in outputs)
        return outputs.detach()

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        exchange = ctx.exchange
        exchange.pending = exchange.plan.start_backward(grads)
        dtype, device = ctx.dummy_meta
        return None, torch.empty(0, dtype=dtype, device=device)
