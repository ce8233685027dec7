"""Finding the sharded modules whose input a pipeline can distribute ahead of the forward.

The pipeline starts a sharded module's ``input_dist`` for the next batch before the model's forward
runs, so the module's input must be computable from the batch alone. The model is traced symbolically
(torch.fx) with every ``ShardedModule`` and ``DistributedDataParallel`` kept as a leaf; a sharded module
qualifies when each of its arguments is the batch reached through attribute accesses and item lookups
only (``batch.sparse_features``, ``batch["sparse"].user``). The trace is only read, never run.
"""

from __future__ import annotations

import builtins
import dataclasses
import operator
from typing import Any, Dict, List, Optional, Tuple

import torch.fx
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.sharding.types import ShardedModule


@dataclasses.dataclass
class ArgInfo:
    """How to get one argument of a pipelined module from the batch.

    Attributes:
        input_attrs: the path from the batch: ``batch.a["b"]`` gives ``["a", "b"]``.
        is_getitems: per step, an item lookup (True) or an attribute access (False).
        name: the keyword of the argument, or None for a positional one.
    """

    input_attrs: List[Any]
    is_getitems: List[bool]
    name: Optional[str]

    def get(self, batch: Any) -> Any:
        """This argument's value for ``batch``."""
        value = batch
        for attr, is_item in zip(self.input_attrs, self.is_getitems):
            value = value[attr] if is_item else getattr(value, attr)
        return value


def build_args(batch: Any, args: List[ArgInfo]) -> Tuple[List[Any], Dict[str, Any]]:
    """The positional and keyword arguments of a pipelined module's call for ``batch``."""
    positional = [a.get(batch) for a in args if a.name is None]
    keywords = {a.name: a.get(batch) for a in args if a.name is not None}
    return positional, keywords


class Tracer(torch.fx.Tracer):
    """An fx tracer that keeps sharded modules, DDP and the modules named in ``leaf_modules`` as leaves.

    Buffers are not proxied (``proxy_buffer_attributes = False``): some models update buffers in
    forward, which a proxy cannot record.
    """

    proxy_buffer_attributes = False

    def __init__(self, leaf_modules: Optional[List[str]] = None) -> None:
        super().__init__()
        self._leaf_modules = set(leaf_modules or ())

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if (
            isinstance(m, (ShardedModule, DistributedDataParallel))
            or module_qualified_name in self._leaf_modules
        ):
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _arg_info(arg: Any, batch_node: torch.fx.Node, name: Optional[str]) -> Optional[ArgInfo]:
    """The ``ArgInfo`` of a traced argument, or None when it is not a pure function of the batch."""
    attrs: List[Any] = []
    getitems: List[bool] = []
    node = arg
    while isinstance(node, torch.fx.Node) and node is not batch_node:
        if node.op != "call_function" or node.target not in (builtins.getattr, operator.getitem):
            return None
        attrs.insert(0, node.args[1])
        getitems.insert(0, node.target is operator.getitem)
        node = node.args[0]
    return ArgInfo(attrs, getitems, name) if node is batch_node else None


def find_pipelineable_modules(model: nn.Module) -> List[Tuple[str, ShardedModule, List[ArgInfo]]]:
    """``(path, module, args)`` of each sharded module of ``model`` (already unwrapped from DMP / DDP)
    whose input is a function of the batch alone, in call order.

    ``model.forward`` must take the batch as its one argument. A sharded module called more than once
    per forward is left out (one input dist per batch is prefetched).
    """
    sharded = {path: m for path, m in model.named_modules() if isinstance(m, ShardedModule)}
    if not sharded:
        return []
    graph = Tracer().trace(model)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise ValueError(
            f"a pipelined model's forward takes the batch as its one argument; "
            f"{type(model).__name__}.forward takes {[n.target for n in placeholders]}"
        )
    calls: Dict[str, List[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in sharded:
            calls.setdefault(node.target, []).append(node)
    found = []
    for path, nodes in calls.items():
        if len(nodes) != 1:
            continue
        node = nodes[0]
        infos = [_arg_info(a, placeholders[0], None) for a in node.args]
        infos += [_arg_info(a, placeholders[0], k) for k, a in node.kwargs.items()]
        if infos and all(info is not None for info in infos):
            found.append((path, sharded[path], infos))
    return found


__all__ = ["ArgInfo", "Tracer", "build_args", "find_pipelineable_modules"]
