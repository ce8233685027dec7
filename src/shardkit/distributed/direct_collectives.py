"""An all-to-all started on the process group object itself, without torch.distributed's Python wrapper.

``torch.distributed.all_to_all_single`` checks its arguments, resolves the group and wraps the call in
an exception logger: about ten Python calls before the ``ProcessGroup`` method it ends in. The byte
exchanges of the comm ops and the KJT all-to-all build their arguments themselves (flat contiguous
tensors of one dtype, int split sizes, a group object), and a training step at small batches starts
four of them, so they call the method directly. Anything else (no group object, a tensor subclass,
a torch.compile trace, a torch without the method) goes through torch's function. CPU exchanges of a
gloo group whose ranks share one host go through shared memory instead (the default;
``SHARDKIT_SHM_EXCHANGE=0`` keeps gloo: :mod:`shardkit.distributed.shm_exchange`).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from shardkit.distributed import shm_exchange

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


def _split_bytes(tensor: torch.Tensor, splits: List[int], world: int) -> List[int]:
    """Bytes per rank of ``splits`` (rows of dim 0; empty: dim 0 divided evenly, as torch's)."""
    rows = tensor.shape[0] if tensor.dim() else 1
    row_bytes = tensor.element_size() * (tensor.numel() // rows if rows else 0)
    if not splits:
        if rows % world:
            raise ValueError(f"all_to_all_single: {rows} rows do not split evenly over {world} ranks")
        splits = [rows // world] * world
    return [n * row_bytes for n in splits]


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
    if shm_exchange.shm_exchange_enabled() and input.device.type == "cpu" and output.device.type == "cpu":
        exchange = shm_exchange.exchange_for(group)
        if exchange is not None:  # one host, gloo: through shared memory
            work = exchange.all_to_all(
                output.reshape(-1).view(torch.uint8),
                input.reshape(-1).view(torch.uint8),
                _split_bytes(output, output_split_sizes, exchange.world),
                _split_bytes(input, input_split_sizes, exchange.world),
            )
            if async_op:
                return work
            work.wait()
            return None
    opts = _OPTIONS.get(async_op) or _options(async_op)  # made on the first call only
    work = group.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)
    if async_op:
        return work
    work.wait()
    return None


def shm_exchange_of(group: Optional[ProcessGroup]) -> Optional[shm_exchange.SharedMemoryExchange]:
    """The shared-memory exchange CPU byte exchanges of ``group`` go through (its
    :meth:`~shardkit.distributed.shm_exchange.SharedMemoryExchange.exchange_parts` lets a caller write
    and read the chunks in place), None where they go through the backend (switched off, ranks on
    several hosts, not gloo, a compiler's trace)."""
    if not shm_exchange.shm_exchange_enabled() or not isinstance(group, ProcessGroup):
        return None
    if torch.compiler.is_compiling():
        return None
    return shm_exchange.exchange_for(group)


def shm_exchange_for(group: Optional[ProcessGroup], tensor: torch.Tensor):
    """:func:`shm_exchange_of` for an exchange of ``tensor``: None unless it is a plain CPU tensor (a
    subclass or another device goes through the backend)."""
    if type(tensor) is not torch.Tensor or tensor.device.type != "cpu":
        return None
    return shm_exchange_of(group)


__all__ = ["all_to_all_single", "shm_exchange_for", "shm_exchange_of"]
