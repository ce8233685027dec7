"""The gp_utils API: a data-parallel x graph-parallel grid of ranks and collectives on its rows.

Graph parallelism splits one graph's nodes / edges over a group of ranks. ``setup_gp(config)`` lays
the world out as ``arange(world).reshape(dp, gp)``: a row (``gp`` consecutive ranks) is a graph-parallel
group, which shares one graph; a column is a data-parallel group, whose ranks see different graphs.
Everything else here works on this rank's graph-parallel group:

- ``pad_tensor`` / ``trim_tensor`` / ``_split_tensor``: local padding and array_split splitting.
- ``CopyToModelParallelRegion`` ... ``GatherFromModelParallelRegion`` and their lower-case wrappers:
  the region mappings of ``shardkit.distributed.regions`` on the graph-parallel group.
- ``gather_from_model_parallel_region_sum_grad``: the gather to use when ranks use the gathered
  tensor for different work (their own edges); the plain gather then drops the other ranks' gradient.
- ``scale_backward_grad``: with DDP over the whole world, a loss computed identically by the ``gp``
  ranks of a row is averaged over ``dp * gp`` ranks, so gradients come out ``gp`` times too small;
  this multiplies the gradient by ``gp`` without touching the forward value.

The module-level state the specified API needs is one object, reset by ``cleanup_gp`` (registered with
``shardkit.distributed.state``). Unlike the system the API comes from, the getters raise before
``setup_gp`` instead of answering with global ranks, padding is zeros rather than uninitialized memory,
nothing modifies a caller's tensor, and uneven splits follow numpy's ``array_split`` rule everywhere.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import format_per_rank, gather_objects
from shardkit.distributed.grid import ParallelGrid
from shardkit.distributed.regions import (
    CopyToRegion,
    GatherFromRegionLocalGrad,
    GatherFromRegionSumGrad,
    ReduceFromRegion,
    ScatterToRegion,
)
from shardkit.distributed.state import register_reset
from shardkit.distributed.tensor_split import (
    divide_and_check_no_remainder,
    ensure_div,
    normalize_dim,
    split_tensor,
)
from shardkit.distributed.tensor_split import pad_tensor as _pad_to
from shardkit.distributed.tensor_split import trim_tensor as _trim_to

# ---------------------------------------------------------------------------------------------------
# state


@dataclass
class _GraphParallelState:
    """The grid made by ``setup_gp``; ``None`` until then and after ``cleanup_gp``."""

    grid: Optional[ParallelGrid] = None

    def reset(self) -> None:
        self.grid = None


_STATE = _GraphParallelState()


def _grid(caller: str) -> ParallelGrid:
    grid = _STATE.grid
    if grid is None:
        raise RuntimeError(f"{caller}: graph parallel is not set up; call setup_gp(config) first")
    return grid


# ---------------------------------------------------------------------------------------------------
# setup and getters


_MISSING = "<missing>"


def _config_value(config: Any, key: str, default: Any) -> Any:
    try:
        return config[key]
    except KeyError:
        return default


def setup_gp(config: Any) -> None:
    """Create the graph-parallel (rows) and data-parallel (columns) groups; every rank must call it.

    ``config["gp_gpus"]``: graph-parallel size, clamped to the world size, which it must then divide.
    ``config["distributed_backend"]``: backend of the new groups (``None`` or absent: the default's).
    Ranks first exchange their view of the call, so a rank that passes a different size, or that is
    already set up, makes every rank raise (``ValueError`` / ``RuntimeError``) instead of hanging.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("setup_gp needs torch.distributed to be initialized (init_process_group)")
    # read without raising: a rank that fails alone before the exchange would leave the others waiting
    gp_gpus = _config_value(config, "gp_gpus", _MISSING)
    backend = _config_value(config, "distributed_backend", None)
    views = gather_objects((gp_gpus, backend, initialized()))
    already = [rank for rank, view in enumerate(views) if view[2]]
    if already:
        raise RuntimeError(
            f"setup_gp: graph parallel is already set up on ranks {already}; call cleanup_gp() first"
        )
    if any(view[:2] != views[0][:2] for view in views[1:]):
        per_rank = format_per_rank([view[:2] for view in views])
        raise ValueError(f"setup_gp: ranks disagree on (gp_gpus, distributed_backend): {per_rank}")
    if gp_gpus is _MISSING:
        raise KeyError("setup_gp: config has no 'gp_gpus' (the graph-parallel size)")
    if isinstance(gp_gpus, bool) or not isinstance(gp_gpus, numbers.Integral) or gp_gpus < 1:
        raise ValueError(f"setup_gp: gp_gpus must be a positive int, got {gp_gpus!r}")
    gp_gpus = int(gp_gpus)
    world_size = dist.get_world_size()
    gp_size = min(gp_gpus, world_size)
    if world_size % gp_size != 0:
        raise ValueError(f"setup_gp: gp_gpus={gp_size} does not divide the world size {world_size}")
    _STATE.grid = ParallelGrid.create(gp_size, backend=backend)


def cleanup_gp() -> None:
    """Destroy the groups made by ``setup_gp`` and forget them; a no-op when there are none.

    Local (no collective), so it is safe to call from a failing rank.
    """
    grid = _STATE.grid
    # forget first: a failure while destroying must not leave groups that look usable
    _STATE.reset()
    if grid is None or not dist.is_initialized():
        return  # destroying the default group already destroyed every subgroup
    for group in (grid.mp_group, grid.dp_group):
        if group is not None and group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)


register_reset("graph_parallel", cleanup_gp)


def initialized() -> bool:
    """Whether ``setup_gp`` has run (and ``cleanup_gp`` has not since)."""
    return _STATE.grid is not None


def get_dp_group() -> dist.ProcessGroup:
    """This rank's data-parallel group (its column of the grid)."""
    return _grid("get_dp_group").dp_group


def get_gp_group() -> dist.ProcessGroup:
    """This rank's graph-parallel group (its row of the grid: ``gp`` consecutive ranks)."""
    return _grid("get_gp_group").mp_group


def get_dp_rank() -> int:
    """This rank's index within its data-parallel group."""
    return _grid("get_dp_rank").dp_rank


def get_gp_rank() -> int:
    """This rank's index within its graph-parallel group."""
    return _grid("get_gp_rank").mp_rank


def get_dp_world_size() -> int:
    """Number of ranks in a data-parallel group (``world // gp``)."""
    return _grid("get_dp_world_size").dp_size


def get_gp_world_size() -> int:
    """Number of ranks in a graph-parallel group (``gp``)."""
    return _grid("get_gp_world_size").mp_size


# ---------------------------------------------------------------------------------------------------
# local tensor helpers

# the specification's name for array_split splitting
_split_tensor = split_tensor


def pad_tensor(tensor: torch.Tensor, dim: int = -1, target_size: Optional[int] = None) -> torch.Tensor:
    """Append zeros along ``dim`` up to ``target_size``, by default the next multiple of the gp size.

    ``[..., n, ...]`` -> ``[..., target_size, ...]``; returns ``tensor`` itself when ``n`` is already
    there, otherwise a new tensor. Differentiable; nothing is saved for backward.
    """
    if target_size is None:
        world_size = get_gp_world_size()
        size = tensor.size(normalize_dim(tensor, dim))
        target_size = -(-size // world_size) * world_size
    return _pad_to(tensor, dim, target_size=target_size)


def trim_tensor(
    tensor: torch.Tensor,
    sizes: Optional[Union[torch.Tensor, Sequence[int]]] = None,
    dim: int = 0,
) -> tuple[torch.Tensor, Optional[Union[torch.Tensor, list[int]]]]:
    """Drop the last ``n % gp`` entries along ``dim`` so that the gp size divides the length.

    ``[..., n, ...]`` -> ``[..., n - n % gp, ...]`` (a view). ``sizes`` (e.g. the number of nodes of each
    graph of a batch, whose last graph owns the trailing entries) comes back with its last entry
    reduced by the same amount, as a new tensor / list: the caller's is not modified.
    """
    world_size = get_gp_world_size()
    size = tensor.size(normalize_dim(tensor, dim))
    remainder = size % world_size
    if remainder == 0:
        return tensor, sizes
    tensor = _trim_to(tensor, dim, target_size=size - remainder)
    if sizes is not None:
        if len(sizes) == 0 or int(sizes[-1]) < remainder:
            raise ValueError(
                f"trim_tensor: cannot remove {remainder} entries from the last of sizes {list(sizes)}"
            )
        if isinstance(sizes, torch.Tensor):
            sizes = sizes.clone()
            sizes[-1] -= remainder
        else:
            sizes = [int(s) for s in sizes]
            sizes[-1] -= remainder
    return tensor, sizes


# ---------------------------------------------------------------------------------------------------
# the specification's private collectives (imported by user code and tests written against it)


def _reduce(ctx: Any, input: torch.Tensor) -> torch.Tensor:
    """Sum ``input`` over the gp group: ``[*]`` -> ``[*]``, same dtype, same shape on every gp rank.

    ``ctx`` is accepted for the specification's signature and not used. Unlike the specified helper,
    which sums in place (and marks ``ctx`` dirty), this returns a new tensor and leaves the caller's
    alone; like it, the result is not connected to autograd (a plain collective). With one gp rank the
    input itself comes back.
    """
    del ctx  # the specification passes the autograd ctx; nothing here needs it
    with torch.no_grad():
        return ReduceFromRegion.apply(input.detach(), get_gp_group())


def _split(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """This gp rank's array_split chunk of ``input`` along ``dim`` (contiguous, a new tensor).

    ``[..., n, ...]`` -> ``[..., n_r, ...]``. No communication. Differentiable as a plain slice: the
    gradient is this rank's own, padded with zeros.
    """
    world_size = get_gp_world_size()
    if world_size == 1:
        return input
    dim = normalize_dim(input, dim)
    return split_tensor(input, world_size, dim)[get_gp_rank()].contiguous()


def _gather_with_padding(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every gp rank's ``input`` along ``dim``; the ranks' sizes there may differ.

    ``[..., n_r, ...]`` -> ``[..., sum n_r, ...]`` (chunks padded with zeros to the largest for the
    all-gather, then trimmed); all other dims must agree (``ValueError`` on every rank otherwise).
    Autograd sees this rank's chunk only, the others being constants, as in the specification, whose
    helper places the input itself in the gathered list: the backward is a local slice.
    """
    return GatherFromRegionLocalGrad.apply(input, dim, get_gp_group())


def _gather(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every gp rank's ``input`` along ``dim`` (``[..., n, ...]`` -> ``[..., gp * n, ...]``).

    The specified helper needs equal sizes along ``dim``; this one also takes uneven ones (it is
    ``_gather_with_padding``). Autograd sees this rank's chunk only (see ``_gather_with_padding``).
    """
    return _gather_with_padding(input, dim)


# ---------------------------------------------------------------------------------------------------
# region mappings on the graph-parallel group
#
# Each class reuses the generic Function's forward and backward with the gp group filled in; the
# backward calls the dual generic Function's apply, so double backward works here too.


class CopyToModelParallelRegion(CopyToRegion):
    """Forward identity, backward all-reduce over the gp group. ``apply(input)``: ``[*]`` -> ``[*]``.

    Saved for backward: the gp group.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor) -> torch.Tensor:
        return CopyToRegion.forward(ctx, input, get_gp_group())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return CopyToRegion.backward(ctx, grad_output)[:1]


class ReduceFromModelParallelRegion(ReduceFromRegion):
    """Forward all-reduce (sum, on a copy) over the gp group, backward identity.

    ``apply(input)``: ``[*]`` (same shape on every gp rank) -> ``[*]``. Saved for backward: the gp group.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor) -> torch.Tensor:
        return ReduceFromRegion.forward(ctx, input, get_gp_group())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return ReduceFromRegion.backward(ctx, grad_output)[:1]


class ScatterToModelParallelRegion(ScatterToRegion):
    """Forward keep this gp rank's array_split chunk along ``dim``, backward gather.

    ``apply(input, dim=-1)``: ``[..., n, ...]`` -> ``[..., n_r, ...]``. Saved for backward: ``dim``,
    the gp group and all chunk sizes.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return ScatterToRegion.forward(ctx, input, dim, get_gp_group())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return ScatterToRegion.backward(ctx, grad_output)[:2]


class GatherFromModelParallelRegion(GatherFromRegionLocalGrad):
    """Forward all-gather + concat along ``dim`` over the gp group (uneven sizes padded with zeros),
    backward keep own chunk of the gradient, by a rank-local slice.

    Per-rank contract (fairchem's): each gp rank's gathered tensor is its own, the other ranks' chunks
    are constants to it, so a rank's gradient comes only from its own loss, at every order: the double
    backward is local zero padding (see ``GatherFromRegionLocalGrad``). When the other ranks'
    contributions are wanted, use ``gather_from_model_parallel_region_sum_grad``.
    ``apply(input, dim=-1)``: ``[..., n_r, ...]`` -> ``[..., sum n_r, ...]``. Saved for backward:
    ``dim``, the gp group and all chunk sizes.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return GatherFromRegionLocalGrad.forward(ctx, input, dim, get_gp_group())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return GatherFromRegionLocalGrad.backward(ctx, grad_output)[:2]


class GatherFromModelParallelRegionSumGrad(GatherFromRegionSumGrad):
    """Forward as ``GatherFromModelParallelRegion``; backward sums the gradient over the gp group, then
    keeps own chunk. ``apply(input, dim=-1)``. Saved for backward: ``dim``, the gp group, chunk sizes.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return GatherFromRegionSumGrad.forward(ctx, input, dim, get_gp_group())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return GatherFromRegionSumGrad.backward(ctx, grad_output)[:2]


class _ScaleBackwardGrad(torch.autograd.Function):
    """Forward identity; backward multiplies the gradient by ``factor`` (a plain, differentiable op)."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return input

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output * ctx.factor, None


def copy_to_model_parallel_region(input: torch.Tensor) -> torch.Tensor:
    """Forward identity, backward all-reduce over the gp group."""
    return CopyToModelParallelRegion.apply(input)


def reduce_from_model_parallel_region(input: torch.Tensor) -> torch.Tensor:
    """Forward all-reduce over the gp group (the input is not modified), backward identity."""
    return ReduceFromModelParallelRegion.apply(input)


def scatter_to_model_parallel_region(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Forward keep own array_split chunk along ``dim``, backward gather over the gp group."""
    return ScatterToModelParallelRegion.apply(input, dim)


def gather_from_model_parallel_region(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Forward all-gather along ``dim`` over the gp group, backward keep own chunk."""
    return GatherFromModelParallelRegion.apply(input, dim)


def gather_from_model_parallel_region_sum_grad(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Forward all-gather along ``dim`` over the gp group, backward sum over the gp group + own chunk.

    Use it when gp ranks use the gathered tensor for different work (e.g. each for its own edges).
    """
    return GatherFromModelParallelRegionSumGrad.apply(input, dim)


# ---------------------------------------------------------------------------------------------------
# fairchem's later, natoms-based gathers, under names that cannot be confused with the specified ones
#
# fairchem's current gp_utils passes the number of atoms (natoms) where the specified version passes
# ``dim``; the same names with a different second parameter would silently gather along the wrong
# dimension, so the natoms forms are separate functions here.


def size_list_fn(size: int, parts: int) -> list[int]:
    """Chunk sizes of ``size`` rows over ``parts`` ranks, the first ``size % parts`` one larger
    (numpy's array_split rule, fairchem's ``size_list_fn``)."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1 or size < 0:
        raise ValueError(f"size_list_fn: need size >= 0 and parts >= 1, got {size} and {parts}")
    return [size // parts + (1 if index < size % parts else 0) for index in range(parts)]


def _gather_nodes(function, input: torch.Tensor, natoms: int, what: str) -> torch.Tensor:
    sizes = size_list_fn(int(natoms), get_gp_world_size())
    # the sizes let the shape exchange be skipped when validation is off; with it on, they are checked
    out = function.apply(input, 0, get_gp_group(), sizes)
    if out.size(0) != natoms:
        # every gp rank gathered the same rows, so every rank raises
        raise ValueError(f"{what}: the gp ranks hold {out.size(0)} node rows in all, natoms is {natoms}")
    return out


def gather_nodes_from_model_parallel_region(input: torch.Tensor, natoms: int) -> torch.Tensor:
    """fairchem's ``gather_from_model_parallel_region(input, natoms)``: node rows ``[n_r, ...]`` on gp
    rank ``r`` (``n_r = size_list_fn(natoms, gp)[r]``) -> ``[natoms, ...]`` on every gp rank.

    Backward: each rank's own rows, by a local slice (per-rank contract, as
    ``gather_from_model_parallel_region``).
    """
    return _gather_nodes(GatherFromRegionLocalGrad, input, natoms, "gather_nodes_from_model_parallel_region")


def gather_nodes_from_model_parallel_region_sum_grad(input: torch.Tensor, natoms: int) -> torch.Tensor:
    """fairchem's ``gather_from_model_parallel_region_sum_grad(input, natoms)``: as
    ``gather_nodes_from_model_parallel_region``, but the backward sums the gradient over the gp ranks
    before keeping own rows (ranks use the gathered nodes for different edges)."""
    return _gather_nodes(
        GatherFromRegionSumGrad, input, natoms, "gather_nodes_from_model_parallel_region_sum_grad"
    )


def scale_backward_grad(input: torch.Tensor) -> torch.Tensor:
    """Forward identity; backward multiplies the gradient by the gp size.

    Apply it to the loss (or the model output) when DDP averages gradients over the whole world: the
    ``gp`` ranks of a row compute one graph's loss together, so the world average is ``gp`` times too
    small compared with data parallelism over ``dp`` ranks.
    """
    return _ScaleBackwardGrad.apply(input, float(get_gp_world_size()))


__all__ = [
    "CopyToModelParallelRegion",
    "_gather",
    "_gather_with_padding",
    "_reduce",
    "_split",
    "_split_tensor",
    "GatherFromModelParallelRegion",
    "GatherFromModelParallelRegionSumGrad",
    "ReduceFromModelParallelRegion",
    "ScatterToModelParallelRegion",
    "cleanup_gp",
    "copy_to_model_parallel_region",
    "divide_and_check_no_remainder",
    "ensure_div",
    "gather_from_model_parallel_region",
    "gather_from_model_parallel_region_sum_grad",
    "gather_nodes_from_model_parallel_region",
    "gather_nodes_from_model_parallel_region_sum_grad",
    "get_dp_group",
    "get_dp_rank",
    "get_dp_world_size",
    "get_gp_group",
    "get_gp_rank",
    "get_gp_world_size",
    "initialized",
    "pad_tensor",
    "reduce_from_model_parallel_region",
    "scale_backward_grad",
    "scatter_to_model_parallel_region",
    "setup_gp",
    "size_list_fn",
    "trim_tensor",
]
