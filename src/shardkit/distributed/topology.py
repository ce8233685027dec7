"""Where this rank sits among nodes: local rank and size, node (group) rank, and the node process groups.

torchrun describes a job as ``num_groups`` nodes of ``local_size`` ranks each, with global ranks
numbered node by node: node ``g`` holds ranks ``g * local_size ... (g + 1) * local_size - 1``. The
functions here read torchrun's environment variables (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``; MPI launchers' equivalents are accepted too) and fall back to values computed from the
world size and global rank when a variable is missing:

- local size: ``LOCAL_WORLD_SIZE``, else the world size (the whole job on one node);
- local rank: ``LOCAL_RANK``, else ``rank % local_size``;
- group rank: ``GROUP_RANK``, else ``rank // local_size``;
- number of groups: ``world_size // local_size``.

``world_size`` / ``rank`` default to torch.distributed's when it is initialized, else to the
``WORLD_SIZE`` / ``RANK`` variables, else to a single process (1 / 0). A variable that contradicts the
world size (a local size that does not divide it, a local rank or group rank out of range) is a
``ValueError`` rather than silently replaced, because it means the launcher and the job disagree.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import assert_same_on_all_ranks
from shardkit.distributed.grid import ParallelGrid
from shardkit.distributed.state import register_reset

# First name is torchrun's; the others are what MPI launchers (MPICH, Open MPI, MVAPICH) set.
_LOCAL_SIZE_VARS = (
    "LOCAL_WORLD_SIZE",
    "MPI_LOCALNRANKS",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MV2_COMM_WORLD_LOCAL_SIZE",
)
_LOCAL_RANK_VARS = (
    "LOCAL_RANK",
    "MPI_LOCALRANKID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MV2_COMM_WORLD_LOCAL_RANK",
)
_GROUP_RANK_VARS = ("GROUP_RANK",)

# (backend) -> (intra-node group, cross-node group) of this rank; cleared by reset_node_groups.
_NODE_GROUPS: dict[str, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def _env_int(names: Sequence[str]) -> Optional[tuple[str, int]]:
    """``(name, value)`` of the first variable of ``names`` that is set (and non-empty), else None."""
    for name in names:
        raw = os.environ.get(name, "")
        if raw.strip() == "":
            continue
        try:
            return name, int(raw)
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    return None


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _resolve_world_size(world_size: Optional[int]) -> int:
    if world_size is None:
        if _dist_ready():
            world_size = dist.get_world_size()
        else:
            found = _env_int(("WORLD_SIZE",))
            world_size = found[1] if found else 1
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    return world_size


def _resolve_rank(rank: Optional[int], world_size: int) -> int:
    if rank is None:
        if _dist_ready():
            rank = dist.get_rank()
        else:
            found = _env_int(("RANK",))
            rank = found[1] if found else 0
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world size {world_size}")
    return rank


def get_local_size(world_size: Optional[int] = None) -> int:
    """Number of ranks per node (torchrun's ``--nproc-per-node``).

    ``LOCAL_WORLD_SIZE`` when set, else ``world_size`` (everything on one node). Raises ``ValueError``
    when the variable is < 1 or does not divide the world size.
    """
    world_size = _resolve_world_size(world_size)
    found = _env_int(_LOCAL_SIZE_VARS)
    if found is None:
        return world_size
    name, local_size = found
    if local_size < 1 or world_size % local_size != 0:
        raise ValueError(f"local world size {name}={local_size} does not divide the world size {world_size}")
    return local_size


def get_local_rank(world_size: Optional[int] = None, rank: Optional[int] = None) -> int:
    """This rank's index on its node, in ``[0, get_local_size())``.

    ``LOCAL_RANK`` when set, else ``rank % local_size``. Raises ``ValueError`` when the variable is out
    of range for the local size.
    """
    world_size = _resolve_world_size(world_size)
    local_size = get_local_size(world_size)
    found = _env_int(_LOCAL_RANK_VARS)
    if found is None:
        return _resolve_rank(rank, world_size) % local_size
    name, local_rank = found
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local rank {name}={local_rank} is out of range for the local size {local_size}")
    return local_rank


def get_group_rank(world_size: Optional[int] = None, rank: Optional[int] = None) -> int:
    """Index of this rank's node (worker group), in ``[0, get_num_groups())``.

    ``GROUP_RANK`` when set, else ``rank // local_size``. Raises ``ValueError`` when the variable is
    out of range for the number of groups.
    """
    world_size = _resolve_world_size(world_size)
    num_groups = get_num_groups(world_size)
    found = _env_int(_GROUP_RANK_VARS)
    if found is None:
        return _resolve_rank(rank, world_size) // get_local_size(world_size)
    name, group_rank = found
    if not 0 <= group_rank < num_groups:
        raise ValueError(f"group rank {name}={group_rank} is out of range for {num_groups} group(s)")
    return group_rank


def get_num_groups(world_size: Optional[int] = None) -> int:
    """Number of nodes (worker groups): ``world_size // get_local_size(world_size)``."""
    world_size = _resolve_world_size(world_size)
    return world_size // get_local_size(world_size)


def _default_backend(device: Optional[torch.device], backend: Optional[str]) -> str:
    if backend is not None:
        return backend
    if device is not None:
        return "nccl" if torch.device(device).type == "cuda" else "gloo"
    return str(dist.get_backend())


def _layout_problem(world_size: int, rank: int) -> tuple[Optional[int], Optional[str]]:
    """``(local_size, None)`` when this rank's environment fits the consecutive node layout.

    Otherwise ``(None, message)``: the message is exchanged with the other ranks instead of raised
    here, so that a misconfiguration on one rank fails every rank rather than leaving them in
    ``new_group``.
    """
    try:
        local_size = get_local_size(world_size)
        local_rank = get_local_rank(world_size, rank)
        group_rank = get_group_rank(world_size, rank)
    except ValueError as err:
        return None, str(err)
    # Group membership below is taken from the global rank; the launcher's view must match it.
    expected = (rank % local_size, rank // local_size)
    if (local_rank, group_rank) != expected:
        return None, (
            f"rank {rank} has local rank {local_rank} and group rank {group_rank}, but with local size "
            f"{local_size} ranks are laid out node by node, so expected {expected[0]} and {expected[1]}"
        )
    return local_size, None


def intra_and_cross_node_pg(
    device: Optional[torch.device] = None,
    backend: Optional[str] = None,
) -> tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    """This rank's ``(intra-node group, cross-node group)``; creates them on first use (collective).

    Every rank of the default group must call this with the same arguments. The groups are created
    once per backend and cached until ``reset_node_groups`` (run by ``shardkit.distributed.state.reset_all``).
    Returns ``(None, None)`` when torch.distributed is not initialized or ``device`` is a meta device.

    ``backend`` defaults to NCCL for a CUDA ``device``, gloo for another device, and the default
    group's backend when no device is given.

    Raises ``ValueError`` on every rank when the ranks disagree on the local size or backend, or when
    a rank's ``LOCAL_RANK`` / ``GROUP_RANK`` do not match the node-by-node layout of global ranks.
    """
    if device is not None and torch.device(device).type == "meta":
        return None, None
    if not _dist_ready():
        return None, None
    world_size, rank = dist.get_world_size(), dist.get_rank()
    backend = _default_backend(device, backend)
    local_size, problem = _layout_problem(world_size, rank)
    # Always collective (also on a cache hit): it is the point where diverging ranks are caught.
    assert_same_on_all_ranks((local_size, backend, problem), "node layout (local size, backend, problem)")
    if problem is not None:
        raise ValueError(problem)  # every rank has the same problem, so every rank raises
    if backend not in _NODE_GROUPS:
        # nodes are the rows of a grid with local_size columns: intra-node = row, cross-node = column
        grid = ParallelGrid.create(local_size, backend=backend)
        _NODE_GROUPS[backend] = (grid.mp_group, grid.dp_group)
    return _NODE_GROUPS[backend]


def reset_node_groups() -> None:
    """Forget the cached node groups (they belong to a default group that is being destroyed)."""
    _NODE_GROUPS.clear()


register_reset("topology.node_groups", reset_node_groups)
