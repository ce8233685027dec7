"""shardkit.checkpoint: resharding across world sizes and plans, ranks without tables, faults.

Three launches: a model trained at 2 ranks is saved; loaded at 3 ranks under another plan (rank 0
then holds no table) and saved again; loaded at 1 rank under a third plan. Every load must give
exactly the tables, fused optimizer state and dense Adam state saved at 2 ranks. The 2-rank launch
also damages copies of its checkpoint (truncated, corrupted, missing files, a crafted ``.metadata``,
a bad manifest), fails a save half way, and checks that each is an error on every rank that leaves
the model and the previous checkpoint as they were; between the launches a rank is killed in the
middle of overwriting the checkpoint, which must then still load exactly.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

import shardkit.checkpoint.checkpointing as checkpointing
from shardkit import checkpoint
from shardkit.checkpoint import CheckpointError
from shardkit.checkpoint.manifest import file_digest
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world
from shardkit.testing.harness import WorldError

TABLES = [("t0", 7), ("t1", 9), ("t2", 5)]
DIM = 4


def _plan(world_size: int) -> dict:
    if world_size == 2:
        return {"t0": row_wise(), "t1": table_wise(rank=1), "t2": column_wise(ranks=[0, 1])}
    if world_size == 3:  # rank 0 holds no table
        return {"t0": table_wise(rank=1), "t1": table_wise(rank=2), "t2": table_wise(rank=2)}
    return {"t0": row_wise(), "t1": column_wise(ranks=[0, 0]), "t2": table_wise(rank=0)}


class _Model(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.dense = nn.Linear(DIM * len(TABLES), 1)  # before sharding, which draws per rank
        configs = [EmbeddingBagConfig(rows, DIM, name=n, feature_names=[f"f_{n}"]) for n, rows in TABLES]
        ebc = EmbeddingBagCollection(configs, fused_optimizer=FusedOptimizerConfig(OptimType.ADAGRAD, lr=0.1))
        plan = construct_module_sharding_plan(ebc, _plan(dist.get_world_size()))
        self.ebc = EmbeddingBagCollectionSharder().shard(ebc, plan, ShardingEnv.from_process_group(None))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.ebc(kjt).values()).sum()


def _batch(step: int) -> KeyedJaggedTensor:
    """Two samples per rank; lengths key-major, as a KeyedJaggedTensor wants them."""
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    lengths = torch.randint(1, 3, (len(TABLES), 2), generator=gen)
    values = torch.cat(
        [torch.randint(0, rows, (int(n.sum()),), generator=gen) for (_, rows), n in zip(TABLES, lengths)]
    )
    return KeyedJaggedTensor([f"f_{n}" for n, _ in TABLES], values, lengths=lengths.reshape(-1))


def _full(value):
    """The whole tensor of a state value on every rank (a collective for sharded values)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, ShardedTensor):
        out = torch.zeros(value.metadata().size, dtype=value.dtype)
        for shard in value.local_shards():
            index = tuple(
                slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)
            )
            out[index] = shard.tensor
        dist.all_reduce(out)
        return out
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key in sorted(tree, key=str) for k, v in _flat(tree[key], f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def _everything(model: _Model, adam: torch.optim.Adam) -> dict:
    """Every saved value, whole: tables, fused state (not the step on a rank without fused shards),
    dense parameters and Adam's state by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model.{k}": _full(v) for k, v in _flat(model.state_dict()).items()}
    out.update({f"fused.{k}": _full(v) for k, v in _flat(model.ebc.fused_optimizer.state_dict()).items()})
    for p, state in adam.state.items():
        out.update({f"adam.{names[id(p)]}.{k}": v.clone() for k, v in state.items()})
    return out


def _assert_same(got: dict, expected: dict, where: str) -> None:
    for key, value in expected.items():
        if key.endswith(".step") and key not in got:
            continue  # a rank without fused shards does not know the fused step
        assert key in got, f"{where}: {key} missing"
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), f"{where}: {key} differs"
        else:
            assert got[key] == value, f"{where}: {key}: {got[key]} != {value}"


def _trained(seed: int, steps: int):
    model = _Model(seed)
    adam = torch.optim.Adam(model.dense.parameters(), lr=0.01)
    for step in range(steps):
        model(_batch(step)).backward()
        for p in model.dense.parameters():
            dist.all_reduce(p.grad)
        adam.step()
        adam.zero_grad()
    return model, adam


def _expect_error(fn, *patterns: str) -> str:
    with pytest.raises(CheckpointError) as info:
        fn()
    message = str(info.value)
    for pattern in patterns:
        assert pattern in message, f"{pattern!r} not in {message!r}"
    return message


def _on_rank0(fn) -> None:
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def _damaged_copy(good: str, bad: str, damage) -> None:
    def make():
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(good, bad)
        damage(bad)

    _on_rank0(make)


def _data_file(directory: str) -> str:
    return os.path.join(directory, sorted(n for n in os.listdir(directory) if n.endswith(".distcp"))[0])


def _truncate(d: str) -> None:
    path = _data_file(d)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip(d: str) -> None:
    path = _data_file(d)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _craft_metadata(marker: str):
    def damage(d: str) -> None:
        with open(os.path.join(d, ".metadata"), "wb") as f:
            pickle.dump(_Evil(marker), f)
        manifest_path = os.path.join(d, "manifest.json")
        manifest = json.load(open(manifest_path))
        manifest["files"][".metadata"] = file_digest(os.path.join(d, ".metadata"))  # checksums pass
        json.dump(manifest, open(manifest_path, "w"))

    return damage


def _save_at_two(root: str) -> dict:
    model, adam = _trained(0, 3)
    expected = _everything(model, adam)
    path = os.path.join(root, "ckpt")
    checkpoint.save(path, model, {"dense": adam, "fused": model.ebc.fused_optimizer})
    assert sorted(os.listdir(root)) == ["ckpt"]  # no temporary directory left behind
    manifest = checkpoint.read_manifest(path)
    assert manifest["world_size"] == 2 and set(manifest["files"]) == set(os.listdir(path)) - {"manifest.json"}

    # faults: each an error on every rank, the fresh model untouched
    fresh, fresh_adam = _trained(1, 1)
    before = _everything(fresh, fresh_adam)
    optimizers = {"dense": fresh_adam, "fused": fresh.ebc.fused_optimizer}
    bad = os.path.join(root, "bad")
    marker = os.path.join(root, "code-ran")
    cases = [
        (_truncate, ["bytes, the manifest says", "truncated"]),
        (_flip, ["checksum mismatch"]),
        (lambda d: os.remove(_data_file(d)), ["missing"]),
        (lambda d: os.remove(os.path.join(d, "manifest.json")), ["manifest.json: missing"]),
        (
            lambda d: open(os.path.join(d, "manifest.json"), "w").write("{not json"),
            ["not a readable manifest"],
        ),
        (_craft_metadata(marker), ["refusing to load", "system"]),
    ]
    for damage, patterns in cases:
        _damaged_copy(path, bad, damage)
        # raised on every rank (the harness fails the test otherwise), naming the rank that found it
        _expect_error(lambda: checkpoint.load(bad, fresh, optimizers), *patterns)
        _assert_same(_everything(fresh, fresh_adam), before, f"after a failed load ({patterns[0]})")
    assert not os.path.exists(marker), "the crafted .metadata ran code"
    # asking for state the checkpoint lacks: dcp's error on every rank, nothing written
    more = dict(optimizers, other=fresh.ebc.fused_optimizer)
    _expect_error(lambda: checkpoint.load(path, fresh, more), "reading checkpoint", "optim.other")
    _assert_same(_everything(fresh, fresh_adam), before, "after asking for missing state")

    # a save that fails half way (files written, no manifest): the previous checkpoint stays whole
    real_digest = checkpointing.file_digest

    def failing_digest(p):
        if dist.get_rank() == 1:
            raise OSError("disk gone")
        return real_digest(p)

    checkpointing.file_digest = failing_digest
    try:
        _expect_error(lambda: checkpoint.save(path, fresh, optimizers), "rank 1: OSError: disk gone")
    finally:
        checkpointing.file_digest = real_digest
    # a save that died between its two renames leaves the old checkpoint aside; load says where
    _on_rank0(lambda: os.rename(path, os.path.join(root, ".ckpt.old-123")))
    _expect_error(lambda: checkpoint.load(path, fresh, optimizers), ".ckpt.old-123")
    checkpoint.save(os.path.join(root, "other"), fresh, optimizers)  # unrelated saves still work
    _on_rank0(lambda: os.rename(os.path.join(root, ".ckpt.old-123"), path))
    checkpoint.load(path, fresh, optimizers)
    _assert_same(_everything(fresh, fresh_adam), expected, "2 -> 2 after the failed save")
    # a torch optimizer with state for a parameter holding shards: refused (one name, a piece per rank)
    sharded_param = next(p for n, p in fresh.named_parameters() if n.startswith("ebc.lookups."))
    per_shard = torch.optim.SGD([sharded_param], lr=0.1, momentum=0.9)
    per_shard.state[sharded_param]["momentum_buffer"] = torch.zeros_like(sharded_param)
    _expect_error(
        lambda: checkpoint.save(os.path.join(root, "x"), fresh, per_shard), "holds this rank's shards"
    )
    # a directory that is not a checkpoint is never replaced
    _on_rank0(
        lambda: os.makedirs(os.path.join(root, "mine")) or open(os.path.join(root, "mine", "x"), "w").close()
    )
    _expect_error(lambda: checkpoint.save(os.path.join(root, "mine"), fresh), "not a shardkit checkpoint")
    return expected if dist.get_rank() == 0 else None


def _die_mid_save(root: str) -> None:
    """Rank 1's process dies while the ranks hash the files they wrote (before the manifest)."""
    model, adam = _trained(7, 1)
    real_digest = checkpointing.file_digest

    def dying_digest(path):
        if dist.get_rank() == 1:
            os._exit(3)
        return real_digest(path)

    checkpointing.file_digest = dying_digest
    checkpoint.save(os.path.join(root, "ckpt"), model, {"dense": adam, "fused": model.ebc.fused_optimizer})


def _reload(root: str, expected: dict, source: str, target) -> bool:
    model, adam = _trained(5, 0)  # another init; Adam has no state yet: built from the checkpoint
    checkpoint.load(os.path.join(root, source), model, {"dense": adam, "fused": model.ebc.fused_optimizer})
    _assert_same(_everything(model, adam), expected, f"{source} -> {dist.get_world_size()} ranks")
    if target:
        checkpoint.save(
            os.path.join(root, target), model, {"dense": adam, "fused": model.ebc.fused_optimizer}
        )
        # torch's documented recipe on a rank holding no fused table (rank 0 here) saves and loads
        state = {"model": model.ebc.state_dict(), "optim": model.ebc.fused_optimizer.state_dict()}
        dcp.save(state, checkpoint_id=os.path.join(root, "raw"))
        dcp.load(state, checkpoint_id=os.path.join(root, "raw"))
        model.ebc.load_state_dict(state["model"])
        model.ebc.fused_optimizer.load_state_dict(state["optim"])
    return True


def test_checkpoint_reshards_and_survives_faults(tmp_path):
    root = str(tmp_path)
    expected = run_world(_save_at_two, 2, root)[0]
    manifest = (tmp_path / "ckpt" / "manifest.json").read_bytes()
    # a rank killed mid-save: the survivor fails within the timeout; the checkpoint is untouched
    with pytest.raises(WorldError, match="rank 1 ---\nworker process died"):
        run_world(_die_mid_save, 2, root, timeout=60, env={"SHARDKIT_TIMEOUT": "10"})
    assert (tmp_path / "ckpt" / "manifest.json").read_bytes() == manifest
    assert any(name.startswith(".ckpt.tmp-") for name in os.listdir(root))  # its files were written
    # ... and loads as saved, at 3 ranks under another plan
    assert all(run_world(_reload, 3, root, expected, "ckpt", "ckpt3"))
    assert all(run_world(_reload, 1, root, expected, "ckpt3", None))
