"""Bad input and bad offload directories on offloaded tables: the same clear error on every rank.

At 2 ranks (row-wise, table-wise and column-wise tables):

- an id past the end of a table on rank 0 only: the error of the in-memory ``fused`` kernel, word for
  word, on every rank, for ``fused_uvm`` and ``fused_uvm_caching`` alike; afterwards the offloaded
  modules train on (no cache slot left pinned) and stay equal to the in-memory one;
- the offload directory missing on rank 1 only, or too small (``/proc``: 0 bytes free) on rank 1 only:
  an error naming rank 1, the directory and the bytes needed, on every rank, when the module is built
  (before any step). (A directory that exists but is not writable cannot be made for root, which
  ignores permission bits; it is not tested here.)
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world
from tests.checkpoint.test_offloaded_checkpoint import assert_equal, batch, everything, sharded, train

KERNELS = ("fused", "fused_uvm", "fused_uvm_caching")


def _out_of_range(root: str) -> dict:
    rank = dist.get_rank()
    models = {k: sharded(k, 0, root) for k in KERNELS}
    train(models["fused"], range(1))
    train(models["fused_uvm"], range(1))
    train(models["fused_uvm_caching"], range(1))
    kjt, _ = batch(1)
    if rank == 0:  # an id past the end of t1 (30 rows, table-wise on rank 1)
        values = kjt.values().clone()
        start = int(kjt.offset_per_key()[kjt.keys().index("f_t1")])
        assert int(kjt.offset_per_key()[kjt.keys().index("f_t1") + 1]) > start, "rank 0 needs an f_t1 id"
        values[start] = 30
        kjt = KeyedJaggedTensor(kjt.keys(), values, lengths=kjt.lengths())
    messages = {}
    for kernel, model in models.items():
        with pytest.raises(ValueError) as info:
            model(kjt)
        messages[kernel] = str(info.value)
    for kernel in KERNELS:
        assert "rank 0" in messages[kernel] and "f_t1" in messages[kernel], messages[kernel]
        assert "out of range" in messages[kernel], messages[kernel]
        assert messages[kernel] == messages["fused"], (kernel, messages)
    for model in models.values():  # the bad batch changed nothing; training goes on
        train(model, range(1, 3))
    want = everything(models["fused"])
    for kernel in ("fused_uvm", "fused_uvm_caching"):
        assert_equal(everything(models[kernel]), want, f"{kernel} after the bad batch")
    return messages


def test_ids_out_of_range_on_offloaded_tables_same_error_every_rank(tmp_path):
    messages = run_world(_out_of_range, 2, str(tmp_path), timeout=300)
    assert messages[0] == messages[1]


def _bad_directory(root: str, bad: str) -> str:
    directory = bad if dist.get_rank() == 1 else root
    with pytest.raises(ValueError) as info:
        sharded("fused_uvm_caching", 0, directory)
    return str(info.value)


@pytest.mark.parametrize("kind", ["missing", "full"])
def test_bad_offload_directory_on_one_rank_fails_on_every_rank(tmp_path, kind):
    bad = str(tmp_path / "no_such_dir") if kind == "missing" else "/proc"
    messages = run_world(_bad_directory, 2, str(tmp_path), bad, timeout=300)
    assert messages[0] == messages[1]
    message = messages[0]
    assert "rank 1" in message and repr(bad) in message and "rank 0" not in message, message
    expected = "does not exist" if kind == "missing" else "has 0 bytes free, the offloaded tables need"
    assert expected in message, message
    assert any(ch.isdigit() for ch in message.split(repr(bad))[1]), f"no byte count: {message}"
    assert not os.path.exists(bad) or kind == "full"
