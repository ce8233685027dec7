"""How the collections meet ``torch.fx`` and TorchScript.

``torch.fx.symbolic_trace`` of a model that holds a collection records the collection as one leaf
call (``call_function`` to :func:`fx_leaf_call` with the collection as its first argument, a
``get_attr`` of the submodule), as torchrec records its sharded modules: the traced program runs the
module's own forward on real tensors, so it equals the module on any input (any number of ids, empty
bags, zero samples, another batch size or key order). The module cannot be the root of the trace
(the graph could not name it): tracing it directly raises a ``TypeError`` saying so.

``torch.jit.script`` is refused with a ``TypeError`` naming the alternatives: TorchScript cannot
compile a KeyedJaggedTensor (a Python class with cached host metadata) nor the kernels' Python
dispatch. ``torch.export.export`` is the supported way to a serialized program (docs/export.md).

The eager cost of this support is one ``isinstance`` check per forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn

__all__ = ["fx_leaf_call", "is_fx_proxy", "refuse_script", "traced_leaf"]


def is_fx_proxy(value: Any) -> bool:
    """True while ``torch.fx.symbolic_trace`` runs a forward (its input is a ``torch.fx.Proxy``)."""
    return isinstance(value, torch.fx.Proxy)


def fx_leaf_call(module: nn.Module, *args: Any) -> Any:
    """``module(*args)``: a traced graph's call of a collection (one node, see the module doc)."""
    return module(*args)


torch.fx.wrap("fx_leaf_call")


def traced_leaf(module: nn.Module, proxy: torch.fx.Proxy, *args: Any) -> Any:
    """The graph node standing for ``module(proxy, *args)`` under ``torch.fx`` tracing."""
    if proxy.tracer.root is module:
        name = type(module).__name__
        raise TypeError(
            f"torch.fx.symbolic_trace cannot trace a {name} as the root module: it is traced as one leaf "
            f"call inside the model that holds it. Trace that model, or wrap the module "
            f"(torch.fx.symbolic_trace(torch.nn.Sequential({name.lower()}))); for a graph of aten ops "
            "use torch.export.export (docs/export.md)"
        )
    return fx_leaf_call(module, proxy, *args)


def refuse_script(module: nn.Module) -> None:
    """``__prepare_scriptable__`` of the collections: ``torch.jit.script`` is not supported."""
    name = type(module).__name__
    raise TypeError(
        f"torch.jit.script does not support shardkit's {name}: TorchScript cannot compile a "
        "KeyedJaggedTensor. Use torch.export.export(model, (kjt,), dynamic_shapes=..., strict=False) "
        "for a serialized program (torch.export.save / load), or torch.fx.symbolic_trace of the model "
        "that holds the module for a Python graph (docs/export.md)"
    )
