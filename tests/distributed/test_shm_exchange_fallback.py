"""Where the shared-memory exchange cannot make its files, every rank uses gloo, with gloo's bytes: no
directory for the control block (no exchange at all: DMP's DDP gets no default hook), or a directory
gone once the exchange is set up (its data files cannot be made: every call through gloo)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from shardkit.distributed import shm_exchange, shm_files
from shardkit.distributed.direct_collectives import all_to_all_single
from shardkit.testing import run_world


def _exchanges_equal_gloos() -> list:
    """Three all-to-alls (the second MiBs per peer) through the exchange path, each equal to gloo's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    same = []
    for scale in (3, 300_000, 5):
        send_splits = [scale * (1 + (rank + d) % 3) for d in range(world)]
        recv_splits = [scale * (1 + (s + rank) % 3) for s in range(world)]
        send = torch.randn(sum(send_splits)) + 1000 * rank
        got, ref = torch.empty(sum(recv_splits)), torch.empty(sum(recv_splits))
        all_to_all_single(got, send, recv_splits, send_splits, dist.group.WORLD, async_op=False)
        dist.all_to_all_single(ref, send, recv_splits, send_splits)
        same.append(torch.equal(got.view(torch.uint8), ref.view(torch.uint8)))
    return same


def _dense_step_hook() -> object:
    """The default hook of a DMP-built DDP over a small dense model (None: DDP's own all-reduce)."""
    from shardkit.model_parallel import DistributedModelParallel
    from shardkit.sharding.types import ShardingPlan

    torch.manual_seed(0)
    dmp = DistributedModelParallel(torch.nn.Linear(3, 1), plan=ShardingPlan({}))
    x = torch.full((2, 3), float(dist.get_rank()))
    dmp(x).sum().backward()
    return dmp._dmp_wrapped_module.comm_hook


def _without_directory(directory: str) -> dict:
    saved = shm_exchange.DIRECTORY
    shm_exchange.DIRECTORY = directory
    shm_exchange.set_shm_exchange(True)
    try:
        same = _exchanges_equal_gloos()
        return {
            "same": same,
            "exchange": shm_exchange.exchange_for(dist.group.WORLD),
            "ddp_hook": _dense_step_hook(),
        }
    finally:
        shm_exchange.DIRECTORY = saved
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()


def test_no_directory_for_the_files_means_gloo_on_every_rank(tmp_path):
    missing = str(tmp_path / "not-there")
    for result in run_world(_without_directory, 3, missing):
        assert result == {"same": [True] * 3, "exchange": None, "ddp_hook": None}, result
    assert not os.path.exists(missing)


def _directory_gone_after_set_up(directory: str) -> dict:
    saved = shm_exchange.DIRECTORY
    shm_exchange.DIRECTORY = directory
    shm_exchange.set_shm_exchange(True)
    try:
        exchange = shm_exchange.exchange_for(dist.group.WORLD)  # the control block is made and unlinked
        dist.barrier()
        if dist.get_rank() == 0:
            os.rmdir(directory)  # empty: no data file yet
        dist.barrier()
        same = _exchanges_equal_gloos()
        return {"set_up": exchange is not None, "same": same, "gloo_only": exchange._gloo_only}
    finally:
        shm_exchange.DIRECTORY = saved
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()


def test_data_files_that_cannot_be_made_send_every_call_through_gloo_on_every_rank(tmp_path):
    directory = tmp_path / "shm"
    directory.mkdir()
    for result in run_world(_directory_gone_after_set_up, 3, str(directory)):
        assert result == {"set_up": True, "same": [True] * 3, "gloo_only": True}, result


def test_files_left_by_killed_ranks_are_removed_once_stale_and_only_then(tmp_path):
    old, fresh, other = (tmp_path / n for n in ("shardkit-x-aa-0-1-1", "shardkit-x-bb-1-0-1", "user-file"))
    for path in (old, fresh, other):
        path.write_bytes(b"x")
    now = fresh.stat().st_mtime
    stale = now - shm_files.STALE_AFTER_S - 1
    os.utime(old, (stale, stale))
    os.utime(other, (stale, stale))
    assert shm_files.remove_stale_files(str(tmp_path), now) == 1
    assert not old.exists() and fresh.exists() and other.exists()
    assert shm_files.remove_stale_files(str(tmp_path), now + shm_files.STALE_AFTER_S + 1) == 1
    assert not fresh.exists() and other.exists()
