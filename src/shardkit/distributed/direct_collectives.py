"""An all-to-all started on the process group object itself, without torch.distributed's Python wrapper.

``torch.distributed.all_to_all_single`` checks its arguments, resolves the group and wraps the call in
an exception logger: about ten Python calls before the ``ProcessGroup`` method it ends in. The byte
exchanges of the comm ops and the KJT all-to-all build their arguments themselves (flat contiguous
tensors of one dtype, int split sizes, a group object), and a training step at small batches starts
four of them, so they call the method directly. Anything else (no group object, a tensor subclass,
a torch.compile trace, a torch without the method) goes through torch's function.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup
_METHOD = getattr(ProcessGroup, "all_to_all_single", None)


_OPTIONS: Dict[bool, dist.AllToAllOptions] = {}


def _options(async_op: bool) -> dist.AllToAllOptions:
    """The options object of an (a)synchronous all-to-all, made once: the group reads it when the
    collective starts and keeps nothing of it, so every call may pass the same one."""
    opts = _OPTIONS.get(async_op)
    if opts is None:
        opts = _OPTIONS[async_op] = dist.AllToAllOptions()
        opts.asyncOp = async_op
    return opts


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: List[int],
    input_split_sizes: List[int],
    group: Optional[ProcessGroup],
    async_op: bool = True,
) -> Optional[dist.Work]:
    """``dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group, async_op)``.

    ``output`` / ``input``: contiguous tensors of one (non-complex) dtype; the splits count their
    elements per rank. Returns the work when ``async_op``, else waits and returns None.
    """
    if (
        _METHOD is None
        or not isinstance(group, ProcessGroup)
        or type(input) is not torch.Tensor
        or type(output) is not torch.Tensor
        or torch.compiler.is_compiling()
    ):
        return dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )
    opts = _OPTIONS.get(async_op) or _options(async_op)  # made on the first call only
    work = group.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)
    if async_op:
        return work
    work.wait()
    return None


__all__ = ["all_to_all_single"]
