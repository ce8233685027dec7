"""A rank that stalls inside a checkpoint's reads or writes: the others fail within the process
group's timeout with a ``CheckpointError`` that names it (as the rest of shardkit names silent ranks,
``shardkit.distributed.timeouts``)."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from shardkit import checkpoint
from shardkit.checkpoint import SafeFileSystemReader
from shardkit.testing import run_world
from shardkit.testing.harness import WorldError

COLLECTIVE_TIMEOUT_S = 3


def _stall_rank_1(cls: type, method: str) -> None:
    """Make ``cls.method`` sleep on rank 1 (its worker is killed before it wakes: nothing to undo)."""
    if dist.get_rank() != 1:
        return
    real = getattr(cls, method)

    def stalled(self, *args, **kwargs):
        time.sleep(60)
        return real(self, *args, **kwargs)

    setattr(cls, method, stalled)


def _stalls_in(root: str, phase: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    path = os.path.join(root, "ckpt")
    if phase == "read":
        checkpoint.save(path, model)
        _stall_rank_1(SafeFileSystemReader, "read_data")
        checkpoint.load(path, model)
    else:
        _stall_rank_1(FileSystemWriter, "write_data")
        checkpoint.save(path, model)


@pytest.mark.parametrize("phase", ["read", "write"])
def test_a_rank_stalling_in_a_checkpoint_is_named(tmp_path, phase):
    with pytest.raises(WorldError) as info:
        run_world(
            _stalls_in,
            2,
            str(tmp_path),
            phase,
            timeout=90,
            env={"SHARDKIT_TIMEOUT": str(COLLECTIVE_TIMEOUT_S)},
        )
    report = str(info.value)
    what = "loading" if phase == "read" else "saving"
    named = rf"CheckpointError: {what} checkpoint \S+ failed on rank 0: a collective timed out "
    assert re.search(named + r"\(rank\(s\) \[1\] did not answer", report), report
