"""Managed-collision checkpoints (issue 23): a load that is refused leaves the model as it was, on every
rank; a resume between two evictions continues exactly as the uninterrupted run (the eviction window
travels with the checkpoint); a checkpoint without the windows is refused, naming them."""

from __future__ import annotations

import pytest
import torch

from shardkit import checkpoint
from shardkit.modules import LFU_EvictionPolicy, MCHManagedCollisionModule
from shardkit.modules.mc_state import WINDOW_KEY
from shardkit.sparse import JaggedTensor
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case
from tests.sharding.test_mc_sharded import TABLES, build, check_state, rank_bags, run_steps, shard


def _snapshot(sharded) -> dict:
    """Every tensor a load could write on this rank: parameters, buffers (tables, fused optimizer
    state, map slices) and the per-table iteration counters."""
    out = {f"p:{n}": p.detach().clone() for n, p in sharded.named_parameters()}
    out.update({f"b:{n}": b.clone() for n, b in sharded.named_buffers()})
    out.update({f"it:{n}": t.clone() for n, t in sharded._managed_collision_collection._iters.items()})
    return out


def _save_one_bucket_map(directory: str) -> bool:
    """World 2: 'rw1' is built with one bucket, so sharding cuts it into 2; train, save."""
    reference = build(True, 2, equivalent=True)
    sharded = shard(build(True, 2, equivalent=False), 2)
    assert run_steps(reference, sharded, range(3)) > 0
    checkpoint.save(directory, sharded, {"fused": sharded.fused_optimizer})
    return True


def _refused_load_changes_nothing(directory: str) -> bool:
    """World 3: 'rw1' is cut into 3 buckets; the checkpoint's map has 2 and is refused, and nothing of
    the model (tables, optimizer state, maps, iteration counters) may have changed on any rank."""
    _, world_size, _ = case.world()
    reference = build(True, world_size, equivalent=True, seed=5)
    sharded = shard(build(True, world_size, equivalent=False, seed=5), world_size)
    assert run_steps(reference, sharded, range(2)) > 0  # a state of its own, other than the saved one
    before = _snapshot(sharded)
    with pytest.raises(checkpoint.CheckpointError, match="the state has 2 buckets, this module 3"):
        checkpoint.load(directory, sharded, {"fused": sharded.fused_optimizer})
    after = _snapshot(sharded)
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == [], changed
    # and it still trains as its unsharded equivalent
    assert run_steps(reference, sharded, range(2, 4)) >= 0
    return True


def test_a_refused_managed_collision_load_leaves_the_model_unchanged(tmp_path):
    assert all(run_world(_save_one_bucket_map, 2, str(tmp_path / "ckpt")))
    assert all(run_world(_refused_load_changes_nothing, 3, str(tmp_path / "ckpt")))


def _train_alone(reference, steps, world_size: int) -> None:
    """Train the unsharded module as ``run_steps`` does (the same global batches and gradients)."""
    keys = [f for _, _, feats, *_ in TABLES.values() for f in feats]
    for step in steps:
        per_rank = [rank_bags(step, r) for r in range(world_size)]
        global_kjt = case.to_kjt({f: [b for r in range(world_size) for b in per_rank[r][f]] for f in keys})
        expected, _ = reference(global_kjt)
        grad = torch.randn(expected.values().shape, generator=torch.Generator().manual_seed(step))
        (expected.values() * grad).sum().div(world_size).backward()


def _build(world_size: int, sharded: bool, seed: int = 0):
    """Intervals 3 and 4 (rw1: 4); every row-wise table 12 buckets (any world size up to 4 loads it)."""
    module = build(True, world_size, equivalent=not sharded, interval_shift=2, rw1_buckets=12, seed=seed)
    return shard(module, world_size) if sharded else module


def _save_between_evictions(directory: str) -> bool:
    """World 2: after 5 steps every table is inside a window (iteration 5, intervals 3 and 4); save."""
    reference, sharded = _build(2, False), _build(2, True)
    assert run_steps(reference, sharded, range(5)) > 0
    modules = sharded._managed_collision_collection._managed_collision_modules.values()
    assert any(m._history[b] for m in modules for b in range(m.buckets()))
    checkpoint.save(directory, sharded, {"fused": sharded.fused_optimizer})
    return True


def _resume_between_evictions(directory: str) -> bool:
    """World 3, other initial weights: load, then 6 more steps (two evictions of every table) equal,
    step by step, the unsharded equivalent trained without interruption (5 steps of the world-2 batches,
    then these), and so do the final tables, optimizer state and maps."""
    _, world_size, _ = case.world()
    uninterrupted = _build(world_size, False)
    _train_alone(uninterrupted, range(5), 2)
    sharded = _build(world_size, True, seed=5)
    checkpoint.load(directory, sharded, {"fused": sharded.fused_optimizer})
    check_state(uninterrupted, sharded)
    assert run_steps(uninterrupted, sharded, range(5, 11)) > 0
    check_state(uninterrupted, sharded)
    return True


def test_a_resume_between_two_evictions_is_exact_at_another_world_size(tmp_path):
    assert all(run_world(_save_between_evictions, 2, str(tmp_path / "ckpt")))
    assert all(run_world(_resume_between_evictions, 3, str(tmp_path / "ckpt")))


class _Holder(torch.nn.Module):
    def __init__(self, without_windows: bool = False) -> None:
        super().__init__()
        self.mc = MCHManagedCollisionModule(12, None, LFU_EvictionPolicy(), 4, 600, buckets=3)
        self._without_windows = without_windows

    def state_dict(self, *args, **kwargs):
        state = super().state_dict(*args, **kwargs)
        if self._without_windows:  # as saved before the windows were part of the state
            state = {k: v for k, v in state.items() if WINDOW_KEY not in k}
        return state


def test_a_checkpoint_without_eviction_windows_is_refused_naming_them(tmp_path):
    old = _Holder(without_windows=True)
    old.mc({"t": JaggedTensor(torch.tensor([5, 250, 450]), lengths=torch.tensor([3]))})
    checkpoint.save(tmp_path / "old", old)
    fresh = _Holder()
    before = {k: v.clone() for k, v in fresh.named_buffers()}
    with pytest.raises(checkpoint.CheckpointError, match="it has no record 'mc._mch_window_0'"):
        checkpoint.load(tmp_path / "old", fresh)
    assert all(torch.equal(before[k], v) for k, v in fresh.named_buffers())
