"""Dists that need no process group: KJTOneToAll, the all-to-one merges, PermutePooledEmbeddings."""

from __future__ import annotations

import pytest
import torch

from shardkit.distributed.awaitable import Awaitable
from shardkit.sharding import KJTList
from shardkit.sharding.dist_data import (
    EmbeddingsAllToOne,
    EmbeddingsAllToOneReduce,
    KJTOneToAll,
    PermutePooledEmbeddings,
    SeqEmbeddingsAllToOne,
)
from tests.sharding._inputs import KEYS, build_kjt, input_rows


def _randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_kjt_one_to_all_splits_keys():
    rows = input_rows(0, [2] * len(KEYS))
    kjt = build_kjt(rows, weighted=True)
    parts = KJTOneToAll([2, 0, 3], world_size=3)(kjt)
    assert isinstance(parts, KJTList) and len(parts) == 3
    assert [p.keys() for p in parts] == [KEYS[:2], [], KEYS[2:]]
    for key in KEYS:
        part = parts[0] if key in KEYS[:2] else parts[2]
        assert part[key].values().tolist() == [v for r in rows[key] for v in r]
        assert torch.equal(part[key].weights(), kjt[key].weights())
    assert all(p.device() == torch.device("cpu") for p in parts)


def test_kjt_one_to_all_rejects_bad_splits():
    with pytest.raises(ValueError, match="2 entries for 3 devices"):
        KJTOneToAll([1, 4], world_size=3)
    with pytest.raises(ValueError, match="sum to 5 keys"):
        KJTOneToAll([1, 1, 1], world_size=3)(build_kjt(input_rows(0, [1] * len(KEYS))))


def test_embeddings_all_to_one_pooled_and_sequence():
    pooled = [_randn(4, d, seed=d).requires_grad_() for d in (2, 3, 1)]
    merged = EmbeddingsAllToOne(torch.device("cpu"), 3, cat_dim=1)(pooled)
    assert isinstance(merged, Awaitable)
    assert torch.equal(merged.wait(), torch.cat(pooled, dim=1))
    (merged * 2).sum().backward()  # used like a tensor: the lazy awaitable waits by itself
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in pooled)
    seq = [_randn(n, 3, seed=n) for n in (2, 0, 5)]
    assert EmbeddingsAllToOne("cpu", 3, cat_dim=0)(seq).wait().shape == (7, 3)
    with pytest.raises(ValueError, match="got 2 tensors for a world of 3"):
        EmbeddingsAllToOne("cpu", 3, cat_dim=1)(pooled[:2])


def test_embeddings_all_to_one_reduce_and_seq():
    xs = [_randn(3, 2, seed=s) for s in range(4)]
    assert torch.equal(EmbeddingsAllToOneReduce("cpu", 4)(xs).wait(), xs[0] + xs[1] + xs[2] + xs[3])
    with pytest.raises(ValueError, match="different shapes"):
        EmbeddingsAllToOneReduce("cpu", 2)([xs[0], xs[0][:1]])
    moved = SeqEmbeddingsAllToOne("cpu", 4)(xs).wait()
    assert len(moved) == 4 and all(torch.equal(a, b) for a, b in zip(moved, xs))
    module = SeqEmbeddingsAllToOne("cpu", 4)
    module.set_device("meta")
    assert module(xs).wait()[0].device.type == "meta"


def test_permute_pooled_embeddings():
    dims = [2, 1, 3]
    x = _randn(4, 6).requires_grad_()
    permute = PermutePooledEmbeddings(dims, [2, 0, 1])
    out = permute(x)
    assert torch.equal(out, torch.cat([x[:, 3:6], x[:, 0:2], x[:, 2:3]], dim=1))
    weights = _randn(4, 6, seed=1)
    (out * weights).sum().backward()
    expected = torch.cat([weights[:, 3:5], weights[:, 5:6], weights[:, 0:3]], dim=1)
    assert torch.equal(x.grad, expected)
    with pytest.raises(ValueError, match="out of range for 3 blocks"):
        PermutePooledEmbeddings(dims, [0, 3])
    with pytest.raises(ValueError, match=r"expected \[B, 6\]"):
        permute(_randn(4, 5))
