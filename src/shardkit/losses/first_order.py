"""``first_order_only``: the backward decorator of the losses whose backward is a closed-form kernel.

A loss's backward here is a fused kernel (softmax recomputed block by block), not a graph of torch
ops, so it has no derivative of its own. ``torch.autograd.function.once_differentiable`` marks that,
but only when the incoming gradient itself requires grad: for ``grad(loss, x, create_graph=True)`` the
incoming gradient is a constant, the result then silently has no ``grad_fn``, and a second-order term
built on it (a gradient penalty, a Hessian-vector product) would treat the loss's gradient as a
constant and come out wrong without a word. This decorator marks the gradients whenever a graph is
being built (``create_graph=True``) and the forward's inputs want gradients, so any attempt to
differentiate them raises ``RuntimeError`` naming the loss.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch


class _NoSecondDerivative(torch.autograd.Function):
    """Identity whose backward raises: the gradient it wraps cannot be differentiated again."""

    @staticmethod
    def forward(ctx, name: str, *grads: torch.Tensor):  # type: ignore[override]
        ctx.name = name
        # views, not the inputs themselves: autograd then gives each output this node as its grad_fn
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):  # type: ignore[override]
        raise RuntimeError(
            f"{ctx.name}: its backward is a closed-form kernel (once_differentiable) and has no "
            "derivative; a second-order term through this loss cannot be computed"
        )


def first_order_only(backward: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a ``Function.backward``: run it without recording, and when a graph is being built,
    return gradients whose own backward raises (see the module doc). Gradients stay as computed."""

    @functools.wraps(backward)
    def wrapper(ctx, *grad_outputs):
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        if not torch.is_grad_enabled() or not any(ctx.needs_input_grad):
            return grads
        single = not isinstance(grads, tuple)
        grads = (grads,) if single else grads
        slots = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
        if not slots:
            return grads[0] if single else grads
        name = type(ctx).__name__.removesuffix("Backward")
        marked = _NoSecondDerivative.apply(name, *(grads[i].detach().requires_grad_() for i in slots))
        out = list(grads)
        for i, g in zip(slots, marked):
            out[i] = g
        return out[0] if single else tuple(out)

    return wrapper
