from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed import topology
from shardkit.distributed.topology import (
    get_group_rank,
    get_local_rank,
    get_local_size,
    get_num_groups,
    intra_and_cross_node_pg,
    reset_node_groups,
)
from shardkit.testing import run_world

_TOPOLOGY_VARS = (
    *topology._LOCAL_SIZE_VARS,
    *topology._LOCAL_RANK_VARS,
    *topology._GROUP_RANK_VARS,
    "WORLD_SIZE",
    "RANK",
)


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables: the test sets exactly the ones it needs."""
    for name in _TOPOLOGY_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ---------------------------------------------------------------- single process, explicit sizes


def test_env_vars_win_over_fallbacks(clean_env):
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("GROUP_RANK", "0")
    # the variables are taken as they are, even where rank would say otherwise
    assert get_local_size(4) == 2
    assert get_local_rank(4, rank=2) == 1
    assert get_group_rank(4, rank=2) == 0
    assert get_num_groups(4) == 2


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fallbacks_without_any_variable_make_one_node(clean_env, world_size):
    assert get_local_size(world_size) == world_size
    assert get_num_groups(world_size) == 1
    for rank in range(world_size):
        assert get_local_rank(world_size, rank) == rank
        assert get_group_rank(world_size, rank) == 0


def test_rank_fallbacks_follow_the_local_size(clean_env):
    clean_env.setenv("LOCAL_WORLD_SIZE", "3")
    assert [get_local_rank(6, r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [get_group_rank(6, r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert get_num_groups(6) == 2


def test_mpi_variables_are_read_when_torchrun_ones_are_missing(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    assert get_local_size(4) == 2
    assert get_local_rank(4, rank=3) == 1


def test_world_size_and_rank_default_to_env_then_to_one_process(clean_env):
    assert (get_local_size(), get_local_rank(), get_group_rank(), get_num_groups()) == (1, 0, 0, 1)
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("RANK", "3")
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    assert (get_local_size(), get_local_rank(), get_group_rank(), get_num_groups()) == (2, 1, 1, 2)


def test_local_size_that_does_not_divide_world_size_names_both(clean_env):
    clean_env.setenv("LOCAL_WORLD_SIZE", "3")
    for call in (get_local_size, get_num_groups, get_local_rank, get_group_rank):
        with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=3 does not divide the world size 4"):
            call(4)


@pytest.mark.parametrize(
    "name, value, call, match",
    [
        ("LOCAL_RANK", "2", get_local_rank, r"LOCAL_RANK=2 is out of range for the local size 2"),
        ("LOCAL_RANK", "-1", get_local_rank, r"LOCAL_RANK=-1 is out of range"),
        ("GROUP_RANK", "2", get_group_rank, r"GROUP_RANK=2 is out of range for 2 group"),
        ("LOCAL_RANK", "one", get_local_rank, r"LOCAL_RANK='one' is not an integer"),
        ("LOCAL_WORLD_SIZE", "0", get_local_size, r"LOCAL_WORLD_SIZE=0 does not divide"),
    ],
)
def test_out_of_range_variables_are_errors(clean_env, name, value, call, match):
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        call(4, rank=0) if call is not get_local_size else call(4)


def test_explicit_rank_out_of_range_is_an_error(clean_env):
    with pytest.raises(ValueError, match="rank 4 is out of range for world size 4"):
        get_local_rank(4, rank=4)


def test_node_groups_are_none_without_distributed():
    assert not dist.is_initialized()
    assert intra_and_cross_node_pg() == (None, None)
    assert intra_and_cross_node_pg(torch.device("meta")) == (None, None)


# ---------------------------------------------------------------- multi-rank


def _view():
    return get_local_rank(), get_local_size(), get_group_rank(), get_num_groups()


@pytest.mark.parametrize("world_size, local", [(1, None), (2, None), (3, None), (4, 2), (4, 1)])
def test_values_under_torchrun_env(world_size, local):
    local_size = local or world_size
    expected = [
        (r % local_size, local_size, r // local_size, world_size // local_size) for r in range(world_size)
    ]
    assert run_world(_view, world_size, local_world_size=local) == expected


def test_fallbacks_use_the_process_group_rank():
    # LOCAL_WORLD_SIZE kept, the per-rank variables removed: computed from dist.get_rank()
    views = run_world(_view, 4, local_world_size=2, env={"LOCAL_RANK": None, "GROUP_RANK": None})
    assert views == [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    # nothing set: one node of the whole world
    views = run_world(_view, 3, env={"LOCAL_RANK": None, "LOCAL_WORLD_SIZE": None, "GROUP_RANK": None})
    assert views == [(0, 3, 0, 1), (1, 3, 0, 1), (2, 3, 0, 1)]


def _members_by_all_reduce(group) -> list[int]:
    # each rank contributes bit 2**rank: the sum spells out exactly the members of the group
    bits = torch.tensor([2 ** dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(bits, group=group)
    value = int(bits.item())
    return [r for r in range(dist.get_world_size()) if value >> r & 1]


def _node_groups():
    intra, cross = intra_and_cross_node_pg()
    again = intra_and_cross_node_pg(torch.device("cpu"), backend="gloo")
    cached = again[0] is intra and again[1] is cross
    seen = (_members_by_all_reduce(intra), _members_by_all_reduce(cross))
    ranks = (dist.get_process_group_ranks(intra), dist.get_process_group_ranks(cross))
    # after a reset the groups are created afresh (collectively) and still connect the same ranks
    reset_node_groups()
    fresh_intra, fresh_cross = intra_and_cross_node_pg()
    fresh = fresh_intra is not intra and fresh_cross is not cross
    fresh_seen = (_members_by_all_reduce(fresh_intra), _members_by_all_reduce(fresh_cross))
    return seen, ranks, cached, fresh, fresh_seen


@pytest.mark.parametrize(
    "world_size, local, intra, cross",
    [
        (4, 2, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
        (4, 1, [[0], [1], [2], [3]], [[0, 1, 2, 3]]),
        (3, None, [[0, 1, 2]], [[0], [1], [2]]),
        (2, None, [[0, 1]], [[0], [1]]),
        (1, None, [[0]], [[0]]),
    ],
)
def test_intra_and_cross_node_groups(world_size, local, intra, cross):
    results = run_world(_node_groups, world_size, local_world_size=local)
    for rank, (seen, ranks, cached, fresh, fresh_seen) in enumerate(results):
        expected = (next(g for g in intra if rank in g), next(g for g in cross if rank in g))
        assert seen == expected, f"rank {rank}"
        assert ranks == expected, f"rank {rank}"
        assert cached and fresh
        assert fresh_seen == expected


@contextlib.contextmanager
def _env(**values):
    # the harness restores the torchrun variables after the task; restore here too, per scenario
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _disagreements():
    rank = dist.get_rank()
    messages = []
    # one rank believes in a different node size
    with _env(**({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"} if rank == 3 else {})):
        with pytest.raises(ValueError, match="ranks disagree on the node layout") as info:
            intra_and_cross_node_pg()
        messages.append(str(info.value))
    # one rank asks for another backend (no NCCL group is ever attempted)
    with pytest.raises(ValueError, match="ranks disagree on the node layout"):
        intra_and_cross_node_pg(torch.device("cuda") if rank == 0 else None)
    # two ranks swapped their LOCAL_RANK: the layout contradicts the global ranks
    with _env(**({"LOCAL_RANK": str(1 - rank % 2)} if rank < 2 else {})):
        with pytest.raises(ValueError, match="ranks disagree") as info:
            intra_and_cross_node_pg()
        messages.append(str(info.value))
    # every rank has the same impossible local size: the same error on every rank
    with _env(LOCAL_WORLD_SIZE="3"):
        with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3 does not divide the world size 4"):
            intra_and_cross_node_pg()
    # nothing was cached by the failures, and the groups still come out right afterwards
    assert not topology._NODE_GROUPS
    intra, cross = intra_and_cross_node_pg()
    return messages, _members_by_all_reduce(intra), _members_by_all_reduce(cross)


def test_disagreement_is_an_error_on_every_rank():
    results = run_world(_disagreements, 4, local_world_size=2)
    expected_groups = [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])]
    for rank, (messages, intra, cross) in enumerate(results):
        assert "rank 3: (None, 'gloo', 'group rank GROUP_RANK=1 is out of range" in messages[0]
        assert "rank 2: (2, 'gloo', None)" in messages[0]
        assert "rank 0 has local rank 1 and group rank 0" in messages[1]
        assert (intra, cross) == expected_groups[rank]
