"""Deep copies of sharded models: process groups are shared, tensors optionally moved.

A sharded model refers to its process group (through every sharded module's ``ShardingEnv``), and a
process group cannot be copied: it is a connection to the other ranks. A copy of the model must talk
to the same ranks over the same group, so during these copies ``copy.deepcopy`` returns a process
group itself.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

DeviceLike = Union[str, int, torch.device]


@contextlib.contextmanager
def shared_process_groups() -> Iterator[None]:
    """Within this context, ``copy.deepcopy`` of a ``ProcessGroup`` returns the group itself."""
    had = "__deepcopy__" in vars(dist.ProcessGroup)
    saved = vars(dist.ProcessGroup).get("__deepcopy__")
    dist.ProcessGroup.__deepcopy__ = lambda self, memo: self
    try:
        yield
    finally:
        if had:
            dist.ProcessGroup.__deepcopy__ = saved
        else:
            del dist.ProcessGroup.__deepcopy__


class sharded_model_copy:  # noqa: N801 - the specification's name
    """Context in which ``copy.deepcopy`` copies a sharded model, its tensors moved to ``device``.

    Every tensor and parameter is copied to ``device`` (``requires_grad`` kept); with ``device=None``
    tensors are not copied at all (the copy shares them). Process groups are shared, not copied::

        dmp = DistributedModelParallel(model)
        with sharded_model_copy("cpu"):
            dmp_cpu = copy.deepcopy(dmp)

    Not thread-safe: it patches ``torch.Tensor.__deepcopy__`` and ``nn.Parameter.__deepcopy__`` for
    the duration of the context.
    """

    def __init__(self, device: Optional[DeviceLike]) -> None:
        self.device = None if device is None else torch.device(device)
        self._saved: Optional[tuple] = None
        self._groups: Optional[contextlib.AbstractContextManager] = None

    def _copy_tensor(self, tensor: torch.Tensor, memo: Any) -> torch.Tensor:
        if self.device is None:
            return tensor
        moved = tensor.detach().to(self.device, copy=True)
        return moved.requires_grad_(tensor.requires_grad) if tensor.is_leaf else moved

    def _copy_parameter(self, param: nn.Parameter, memo: Any) -> nn.Parameter:
        if self.device is None:
            return param
        return nn.Parameter(param.detach().to(self.device, copy=True), requires_grad=param.requires_grad)

    def __enter__(self) -> sharded_model_copy:
        self._saved = (torch.Tensor.__deepcopy__, nn.Parameter.__deepcopy__)
        copy_tensor, copy_parameter = self._copy_tensor, self._copy_parameter
        torch.Tensor.__deepcopy__ = lambda t, memo: copy_tensor(t, memo)
        nn.Parameter.__deepcopy__ = lambda p, memo: copy_parameter(p, memo)
        self._groups = shared_process_groups()
        self._groups.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.__deepcopy__, nn.Parameter.__deepcopy__ = self._saved
        self._groups.__exit__(*exc)


__all__ = ["shared_process_groups", "sharded_model_copy"]
