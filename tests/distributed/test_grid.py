import pytest
import torch
import torch.distributed as dist

from shardkit.distributed.grid import ParallelGrid, grid_layout
from shardkit.testing import run_world


@pytest.mark.parametrize(
    "world_size, mp_size, rows",
    [
        (4, 2, [[0, 1], [2, 3]]),
        (4, 1, [[0], [1], [2], [3]]),
        (3, 3, [[0, 1, 2]]),
        (6, 3, [[0, 1, 2], [3, 4, 5]]),
    ],
)
def test_layout_is_arange_reshaped(world_size, mp_size, rows):
    assert grid_layout(world_size, mp_size) == rows
    assert rows == torch.arange(world_size).reshape(-1, mp_size).tolist()


def test_layout_rejects_a_non_divisor():
    with pytest.raises(ValueError, match="model-parallel size 3 does not divide the world size 4"):
        grid_layout(4, 3)


def _grid_membership(mp_size):
    grid = ParallelGrid.create(mp_size)
    # membership checked by communication, not only by the rank lists
    mp_sum = torch.tensor([float(dist.get_rank())])
    dp_sum = mp_sum.clone()
    dist.all_reduce(mp_sum, group=grid.mp_group)
    dist.all_reduce(dp_sum, group=grid.dp_group)
    return (
        grid.mp_ranks,
        grid.dp_ranks,
        grid.mp_rank,
        grid.dp_rank,
        grid.dp_size,
        mp_sum.item(),
        dp_sum.item(),
    )


def test_grid_groups_are_rows_and_columns():
    results = run_world(_grid_membership, 4, 2)
    table = torch.arange(4).reshape(2, 2)
    for rank, (mp_ranks, dp_ranks, mp_rank, dp_rank, dp_size, mp_sum, dp_sum) in enumerate(results):
        row, col = divmod(rank, 2)
        assert mp_ranks == table[row].tolist() and dp_ranks == table[:, col].tolist()
        assert (mp_rank, dp_rank, dp_size) == (col, row, 2)
        assert mp_sum == sum(mp_ranks) and dp_sum == sum(dp_ranks)


def _disagreeing_grid():
    with pytest.raises(ValueError, match="ranks disagree on the grid"):
        ParallelGrid.create(1 if dist.get_rank() == 0 else 2)
    return True


def test_ranks_disagreeing_on_the_grid_fail_on_every_rank():
    assert run_world(_disagreeing_grid, 2, timeout=60) == [True, True]
