"""Collective control flow: run a function on one rank and share its result, pick a leader, sum a scalar.

``invoke_on_rank_and_broadcast_result`` is how a decision that must be made once (allocating an id,
reading a file, choosing a plan) reaches every rank. It never leaves the other ranks waiting for a
result that will not come: the invoking rank always broadcasts an envelope, either the result or the
description of the exception that replaced it, and every rank raises in the second case.
"""

from __future__ import annotations

import functools
import numbers
import pickle
import traceback
from typing import Any, Callable, Optional, TypeVar, Union

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import group_rank, group_size

T = TypeVar("T")

_OK = "ok"
_ERROR = "error"


class RemoteInvocationError(RuntimeError):
    """Raised on the ranks that did not invoke the function when it raised on the rank that did.

    Attributes:
        rank: the invoking rank (within the group).
        exc_type: qualified name of the exception raised there.
        remote_traceback: its formatted traceback, as text.
    """

    def __init__(self, message: str, rank: int, exc_type: str, remote_traceback: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback


def is_leader(pg: Optional[dist.ProcessGroup], leader_rank: int = 0) -> bool:
    """Whether this process is rank ``leader_rank`` of ``pg``.

    ``pg`` None means this process is the only member of its group (a single-process program), so it
    is the leader exactly when ``leader_rank`` is 0.
    """
    if pg is None:
        return leader_rank == 0
    return dist.get_rank(pg) == leader_rank


def _func_name(func: Callable[..., Any]) -> str:
    return getattr(func, "__qualname__", None) or repr(func)


def _member_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank in ``group``; ``ValueError`` for a non-member (its collectives are no-ops)."""
    rank = group_rank(group)
    if rank < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of the process group {group!r}")
    return rank


def _invoke_and_pack(
    func: Callable[..., T], args: tuple, kwargs: dict
) -> tuple[tuple, Any, Optional[BaseException]]:
    """Run ``func`` and describe the outcome as a picklable envelope.

    Returns ``(envelope, result, exception)``. The result is pickled here rather than inside the
    broadcast, so that an unpicklable result is an error we can announce instead of one that stops
    this rank before the broadcast (and leaves the others waiting).
    """
    try:
        result = func(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - any failure must reach the other ranks
        return (_ERROR, type(err).__qualname__, str(err), traceback.format_exc()), None, err
    try:
        payload = pickle.dumps(result)
    except Exception as err:  # noqa: BLE001 - pickling can fail with many exception types
        wrapped = TypeError(f"the result of {_func_name(func)} cannot be pickled for broadcast: {err!r}")
        wrapped.__cause__ = err
        return (_ERROR, "TypeError", str(wrapped), traceback.format_exc()), None, wrapped
    return (_OK, payload), result, None


def invoke_on_rank_and_broadcast_result(
    pg: Optional[dist.ProcessGroup], rank: int, func: Callable[..., T], *args: Any, **kwargs: Any
) -> T:
    """Call ``func(*args, **kwargs)`` on rank ``rank`` of ``pg`` only and return its result on every rank.

    Collective: every rank of ``pg`` (the default group when None) must call it. ``rank`` is a rank
    within ``pg``. The result must be picklable; the invoking rank gets the object itself, the others
    an unpickled copy. With a single rank (or no initialized torch.distributed) it is a plain call.

    If ``func`` raises on the invoking rank, that rank re-raises the exception and every other rank
    raises ``RemoteInvocationError`` carrying its type, message and traceback; no rank hangs.

    Example: ``id = invoke_on_rank_and_broadcast_result(pg, 0, allocate_id)``.
    """
    my_rank = _member_rank(pg)
    size = group_size(pg)
    if not 0 <= rank < size:
        raise ValueError(f"invoking rank {rank} is out of range for a process group of size {size}")
    if size == 1:
        return func(*args, **kwargs)
    result, error = None, None
    box: list[Any] = [None]
    if my_rank == rank:
        box[0], result, error = _invoke_and_pack(func, args, kwargs)
    # broadcast_object_list takes the source as a global rank
    src = rank if pg is None else dist.get_global_rank(pg, rank)
    dist.broadcast_object_list(box, src=src, group=pg)
    if my_rank == rank:
        if error is not None:
            raise error
        return result  # type: ignore[return-value]
    return _unpack(box[0], rank, func)


def _unpack(envelope: tuple, rank: int, func: Callable[..., Any]) -> Any:
    if envelope[0] == _OK:
        return pickle.loads(envelope[1])
    _, exc_type, message, remote_tb = envelope
    raise RemoteInvocationError(
        f"{_func_name(func)} raised {exc_type} on rank {rank}: {message}\n"
        f"--- traceback on rank {rank} ---\n{remote_tb}",
        rank=rank,
        exc_type=exc_type,
        remote_traceback=remote_tb,
    )


def run_on_leader(
    pg: Optional[dist.ProcessGroup], rank: int
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorator: calls of the decorated function run on rank ``rank`` of ``pg`` and return everywhere.

    Each call is collective (see ``invoke_on_rank_and_broadcast_result``).
    """

    def decorate(func: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(func)
        def wrapped(*args: Any, **kwargs: Any) -> T:
            return invoke_on_rank_and_broadcast_result(pg, rank, func, *args, **kwargs)

        return wrapped

    return decorate


Scalar = Union[torch.Tensor, int, float, bool]


def _scalar_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Device for a Python-number scalar: NCCL only reduces CUDA tensors, everything else takes CPU."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_fp32_scalar(
    value: Any, group: Optional[dist.ProcessGroup]
) -> tuple[Optional[torch.Tensor], Optional[str]]:
    """``(fresh fp32 0-dim copy, None)`` for a real scalar, ``(None, what is wrong)`` otherwise."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None, f"expected a scalar, got a tensor of shape {tuple(value.shape)}"
        if value.is_complex():
            return None, f"expected a real scalar, got a tensor of dtype {value.dtype}"
        # copy=True: .to() returns the input itself when it is already fp32
        return value.detach().reshape(()).to(torch.float32, copy=True), None
    if isinstance(value, numbers.Real):
        try:
            number = float(value)
        except OverflowError:
            return None, f"scalar {value!r} does not fit in fp32"
        return torch.tensor(number, dtype=torch.float32, device=_scalar_device(group)), None
    return None, f"expected a real scalar (number or one-element tensor), got {type(value).__name__}"


def all_reduce_sum_scalar(
    value: Scalar, group: Optional[dist.ProcessGroup] = None, *, check: bool = True
) -> torch.Tensor:
    """Sum a scalar over ``group`` (the default group when None); returns a fresh fp32 0-dim tensor.

    ``value`` is a Python number or a one-element tensor of any real dtype; it is converted to fp32
    (so integers above 2**24 round) and never modified. The result is on ``value``'s device (a Python
    number goes to CPU, or the current CUDA device under NCCL), is detached from autograd, and equals a
    copy of ``value`` when torch.distributed is not initialized or the group has one rank.

    Raises ``ValueError`` on every rank when any rank passes something that is not a real scalar: a
    validity flag travels in the same all-reduce, which costs one host sync to read. ``check=False``
    skips the flag (no host sync, for hot CUDA paths); a bad value then raises on its own rank only,
    before the collective, and the other ranks wait for it until the group's timeout.
    """
    my_rank = _member_rank(group)
    local, problem = _as_fp32_scalar(value, group)
    size = group_size(group)
    if size == 1 or not check:
        if problem is not None:
            raise ValueError(f"all_reduce_sum_scalar on rank {my_rank}: {problem}")
        if size > 1:
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        return local
    device = local.device if local is not None else _scalar_device(group)
    buf = torch.zeros(2, dtype=torch.float32, device=device)  # [value, number of invalid ranks]
    if local is not None:
        buf[0] = local
    else:
        buf[1] = 1.0
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    if problem is not None:
        raise ValueError(f"all_reduce_sum_scalar on rank {my_rank}: {problem}")
    invalid = int(buf[1].item())
    if invalid:
        raise ValueError(
            f"all_reduce_sum_scalar: {invalid} of {size} ranks passed a value that is not a real scalar"
        )
    return buf[0].clone()
