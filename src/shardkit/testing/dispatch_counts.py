"""Count the torch ops a block issues and the calls among them that would stall the host on a GPU.

A step of an offloaded CUDA table is bound by the host's issue time (one small op is a few
microseconds of Python and dispatch) and by its host syncs (each one waits for the GPU to catch up).
Both can be counted on CPU tensors, where the same ops run: :class:`DispatchCounts` records every aten
op dispatched inside its block (a ``TorchDispatchMode``) and every call that needs the values on the
host, which on CUDA tensors is a device-to-host sync:

- ``aten._local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``, ``float(t)``), ``aten.equal``
  and ``aten.is_nonzero`` (a Python bool from the values);
- ops whose output size depends on the values: ``nonzero``, ``masked_select``, ``unique``-like ops,
  ``repeat_interleave`` without ``output_size``, indexing or ``index_put_`` with a boolean mask;
- ``Tensor.tolist()`` (on CPU tensors it dispatches nothing, so it is counted by wrapping the method
  while the block runs).

``torch.cuda.set_sync_debug_mode`` is the ground truth on a GPU (``benchmarks/offload_gpu_syncs.py``);
this counter is what the CPU tests and the ``--device cpu`` rows use. Not thread-safe: count one thread.
"""

from __future__ import annotations

import collections
from typing import Any, Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_HOST_VALUES = {
    "aten::equal",
    "aten::is_nonzero",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::unique_dim_consecutive",
}


def _needs_host(func: Any, args: tuple, kwargs: Dict[str, Any]) -> bool:
    name = func._schema.name
    if name == "aten::_local_scalar_dense" or name in _HOST_VALUES:
        return True
    if name == "aten::repeat_interleave":
        return kwargs.get("output_size") is None and (len(args) < 3 or args[2] is None)
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
    return False


class DispatchCounts(TorchDispatchMode):
    """``with DispatchCounts() as counts: ...``; then ``counts.ops`` (aten ops dispatched),
    ``counts.kernels`` (those that are not views: on a GPU, each launches work), ``counts.syncs``
    (calls that need values on the host), ``counts.by_op`` and ``counts.sync_ops`` (Counters by op
    name)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: collections.Counter = collections.Counter()
        self.sync_ops: collections.Counter = collections.Counter()
        self.views = 0
        self._tolist = None

    @property
    def ops(self) -> int:
        return sum(self.by_op.values())

    @property
    def kernels(self) -> int:
        return self.ops - self.views

    @property
    def syncs(self) -> int:
        return sum(self.sync_ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        self.by_op[name] += 1
        self.views += bool(getattr(func, "is_view", False))
        if _needs_host(func, args, kwargs):
            self.sync_ops[name] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        original = self._tolist = torch.Tensor.tolist
        counts = self

        def tolist(tensor: torch.Tensor):
            counts.sync_ops["Tensor.tolist"] += 1
            return original(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


__all__ = ["DispatchCounts"]
