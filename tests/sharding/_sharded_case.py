"""Shared set-up of the sharded-module tests: tables with one sharding type each, the plan, the batches.

Every rank builds every rank's batch from fixed seeds, so the unsharded reference can run on the
global batch anywhere. Rank r has ``2 + r`` samples (uneven batches), or none when it is one of the
``empty`` ranks a test names (a zero-sample batch, e.g. the last batch of an epoch).
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist

from shardkit.modules import PoolingType
from shardkit.sharding.sharding_plan import (
    column_wise,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from shardkit.sparse import KeyedJaggedTensor

LR = 0.1
STEPS = 3

# (table, rows, dim, features, pooling); rows and dims chosen so that splits are uneven at 3 and 4 ranks
TABLES = [
    ("t_tw", 11, 4, ["f_tw"], PoolingType.SUM),
    ("t_cw", 13, 5, ["f_cw1", "f_cw2"], PoolingType.MEAN),
    ("t_rw", 13, 4, ["f_rw"], PoolingType.SUM),
    ("t_dp", 7, 3, ["f_dp"], PoolingType.SUM),
    ("t_twrw", 10, 4, ["f_twrw"], PoolingType.SUM),
    ("t_twcw", 8, 6, ["f_twcw"], PoolingType.MEAN),
    ("t_tw2", 5, 4, ["f_tw2"], PoolingType.SUM),
    ("t_rw_small", 2, 4, ["f_rw_small"], PoolingType.SUM),  # fewer rows than ranks: empty row blocks
    # MEAN under row splits: each rank holds part of a bag, the mean is of the whole bag
    ("t_rw_mean", 9, 4, ["f_rw_mean"], PoolingType.MEAN),
    ("t_twrw_mean", 7, 3, ["f_twrw_mean"], PoolingType.MEAN),
]


def world() -> Tuple[int, int, int]:
    """(rank, world size, ranks per node) of this worker."""
    size = dist.get_world_size()
    return dist.get_rank(), size, int(os.environ.get("LOCAL_WORLD_SIZE", size))


def plan_generators(world_size: int, local_size: int, with_dp: bool) -> Dict[str, object]:
    """One sharding type per table; column shards uneven (5 columns in 3 blocks, 2 on one rank)."""
    hosts = world_size // local_size
    gens = {
        "t_tw": table_wise(rank=world_size - 1),
        "t_tw2": table_wise(rank=0),
        "t_cw": column_wise(ranks=[0, world_size - 1, world_size - 1]),
        "t_rw": row_wise(),
        "t_rw_small": row_wise(),
        "t_twrw": table_row_wise(host_index=hosts - 1),
        "t_twcw": table_column_wise(host_index=0),
        "t_rw_mean": row_wise(),
        "t_twrw_mean": table_row_wise(host_index=0),
    }
    if with_dp:
        gens["t_dp"] = data_parallel()
    return gens


def table_rows(name: str) -> int:
    return next(rows for t, rows, *_ in TABLES if t == name)


def batch_size(rank: int, empty: Sequence[int] = ()) -> int:
    """Rank ``rank``'s number of samples: ``2 + rank``, or 0 for one of the ``empty`` ranks."""
    return 0 if rank in empty else 2 + rank


def batch_rows(
    step: int, rank: int, features: List[Tuple[str, int]], samples: Optional[int] = None
) -> Dict[str, List[List[int]]]:
    """Rank ``rank``'s bags at ``step``: ``{feature: [[ids of sample b], ...]}`` (some bags empty);
    ``samples`` bags per feature (``2 + rank`` by default)."""
    gen = torch.Generator().manual_seed(7919 * step + 104729 * rank + 1)
    out = {}
    for feature, rows in features:
        lengths = torch.randint(0, 4, (2 + rank if samples is None else samples,), generator=gen).tolist()
        out[feature] = [torch.randint(0, rows, (n,), generator=gen).tolist() for n in lengths]
    return out


def to_kjt(bags: Dict[str, List[List[int]]]) -> KeyedJaggedTensor:
    keys = list(bags)
    lengths = torch.tensor([len(b) for k in keys for b in bags[k]], dtype=torch.int64)
    values = torch.tensor([v for k in keys for b in bags[k] for v in b], dtype=torch.int64)
    return KeyedJaggedTensor(keys, values, lengths=lengths)


def global_and_local(
    step: int,
    rank: int,
    world_size: int,
    features: List[Tuple[str, int]],
    weighted: bool,
    empty: Sequence[int] = (),
    unused: Sequence[int] = (),
) -> Tuple[KeyedJaggedTensor, KeyedJaggedTensor, List[int]]:
    """(global KJT of all ranks' samples in rank order, this rank's KJT, each rank's batch size).

    The local KJT lists its keys in reverse order, so the sharded module's permutation is exercised.
    The ranks in ``empty`` have zero samples (a KJT of stride 0); those in ``unused`` have one more
    key, :data:`UNUSED`, that no table looks up (see :func:`with_unused_feature`).
    """
    sizes = [batch_size(r, empty) for r in range(world_size)]
    per_rank = [batch_rows(step, r, features, sizes[r]) for r in range(world_size)]
    if weighted:
        global_kjt = _with_rank_weights(per_rank, features, step)
        local_kjt = _with_rank_weights([per_rank[rank]], features, step, offset_rank=rank)
    else:
        global_kjt = to_kjt({f: [b for r in range(world_size) for b in per_rank[r][f]] for f, _ in features})
        local_kjt = to_kjt(per_rank[rank])
    reversed_keys = list(reversed(local_kjt.keys()))
    local_kjt = local_kjt.permute([local_kjt.keys().index(k) for k in reversed_keys])
    if rank in unused:
        local_kjt = with_unused_feature(local_kjt)
    return global_kjt, local_kjt, sizes


UNUSED = "unused_feature"


def with_unused_feature(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """``kjt`` with one more key first, :data:`UNUSED`, that no table looks up: two ids per sample,
    outside every table (-1 and 10**9), with weights when ``kjt`` has them (a leaf's stay leaves)."""
    batch = kjt.stride()
    lengths = torch.cat([torch.full((batch,), 2, dtype=kjt.lengths().dtype), kjt.lengths()])
    values = torch.cat([torch.tensor([-1, 10**9] * batch, dtype=kjt.values().dtype), kjt.values()])
    weights = kjt.weights_or_none()
    if weights is not None:
        weights = torch.cat([torch.ones(2 * batch, dtype=weights.dtype), weights])
    return KeyedJaggedTensor([UNUSED, *kjt.keys()], values, weights, lengths=lengths)


def _weight(step: int, rank: int, feature: str, bag: int, pos: int) -> float:
    return 0.5 + ((step * 31 + rank * 17 + len(feature) * 7 + bag * 5 + pos * 3) % 11) / 10


def _with_rank_weights(per_rank, features, step, offset_rank: int = 0) -> KeyedJaggedTensor:
    keys = [f for f, _ in features]
    lengths, values, weights = [], [], []
    for f in keys:
        for i, bags in enumerate(per_rank):
            for b, bag in enumerate(bags[f]):
                lengths.append(len(bag))
                values.extend(bag)
                weights.extend(_weight(step, i + offset_rank, f, b, p) for p in range(len(bag)))
    return KeyedJaggedTensor(
        keys,
        torch.tensor(values, dtype=torch.int64),
        torch.tensor(weights, dtype=torch.float32),
        lengths=torch.tensor(lengths, dtype=torch.int64),
    )


def with_leaf_weights(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """``kjt`` with its weights replaced by a copy that requires grad (a leaf, for ``.grad``)."""
    weights = kjt.weights().detach().clone().requires_grad_()
    return KeyedJaggedTensor(kjt.keys(), kjt.values(), weights, lengths=kjt.lengths())


def weight_grads(kjt: KeyedJaggedTensor, rows: Optional[slice] = None) -> Dict[str, torch.Tensor]:
    """Per feature, the gradient of the weights of the ids of samples ``rows`` (all by default)."""
    grads = KeyedJaggedTensor(kjt.keys(), kjt.values(), kjt.weights().grad, lengths=kjt.lengths())
    out = {}
    for key, jt in grads.to_dict().items():
        offsets = jt.offsets().tolist()
        start, stop, _ = (rows or slice(None)).indices(len(offsets) - 1)
        out[key] = jt.weights()[offsets[start] : offsets[stop]]
    return out


def my_rows(rank: int, batch_per_rank: List[int]) -> slice:
    start = sum(batch_per_rank[:rank])
    return slice(start, start + batch_per_rank[rank])


def raises_value_error(fn, *words: str) -> None:
    """``fn()`` raises ``ValueError`` whose message holds every one of ``words`` (run on every rank:
    a bad plan or input must fail on all of them)."""
    with pytest.raises(ValueError) as info:
        fn()
    for word in words:
        assert word in str(info.value), str(info.value)


def train_and_compare(
    reference: torch.nn.Module,
    sharded: torch.nn.Module,
    features: List[Tuple[str, int]],
    weighted: bool,
    tol: Dict[str, float],
    empty: Sequence[int] = (),
    unused: Sequence[int] = (),
) -> None:
    """``STEPS`` training steps of ``sharded`` on this rank's batches and of ``reference`` on the
    global batch, checking the pooled outputs and, ``weighted``, the input weights' gradients.
    The ranks in ``empty`` have zero samples at every step, those in ``unused`` an unused feature.

    The comm ops divide gradients by the world size (DDP's mean), so the reference loss is a mean
    over ranks; data-parallel replicas are averaged and stepped as DDP + SGD would."""
    rank, world_size, _ = world()
    for step in range(STEPS):
        global_kjt, local_kjt, batch = global_and_local(
            step, rank, world_size, features, weighted, empty, unused
        )
        if weighted:  # the input weights' gradients too (through the KJT all-to-all's backward)
            global_kjt, local_kjt = with_leaf_weights(global_kjt), with_leaf_weights(local_kjt)
        expected = reference(global_kjt)
        grad = torch.randn(expected.values().shape, generator=torch.Generator().manual_seed(step))
        (expected.values() * grad).sum().div(world_size).backward()
        out = sharded(local_kjt)
        assert out.keys() == expected.keys()
        mine = my_rows(rank, batch)
        torch.testing.assert_close(out.values(), expected.values()[mine].detach(), **tol)
        (out.values() * grad[mine]).sum().backward()
        average_dense_gradients_(sharded, world_size)
        if weighted:
            expected_grads = weight_grads(global_kjt, mine)
            for key, got in weight_grads(local_kjt).items():
                # the unused feature's weights reach nothing: zero gradient
                want = torch.zeros_like(got) if key == UNUSED else expected_grads[key]
                torch.testing.assert_close(got, want, **tol, msg=f"weight grads of {key}")


def average_dense_gradients_(module: torch.nn.Module, world_size: int) -> None:
    """What DDP does for the data-parallel tables: average their gradients, then plain SGD."""
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            with torch.no_grad():
                param.add_(param.grad, alpha=-LR / world_size)
            param.grad = None


def variable_batch(
    step: int,
    rank: int,
    world_size: int,
    features: List[Tuple[str, int]],
    sizes: Optional[Sequence[int]] = None,
) -> Tuple[KeyedJaggedTensor, KeyedJaggedTensor, List[int]]:
    """Like :func:`global_and_local` with a variable batch per feature: rank r has ``sizes[r]``
    samples (``2 + r`` by default), feature i has ``1 + (r + i) % 3`` bags on it (none on a rank with
    zero samples), and inverse indices map samples to bags."""
    keys = [f for f, _ in features]
    sizes = [2 + r for r in range(world_size)] if sizes is None else list(sizes)
    bags = [[1 + (r + i) % 3 if sizes[r] else 0 for r in range(world_size)] for i in range(len(keys))]
    rows, inverse = [], []
    for r in range(world_size):
        gen = torch.Generator().manual_seed(7919 * step + 104729 * r + 5)
        rows.append(
            {
                f: [
                    torch.randint(
                        0, n, (int(torch.randint(0, 4, (1,), generator=gen)),), generator=gen
                    ).tolist()
                    for _ in range(bags[i][r])
                ]
                for i, (f, n) in enumerate(features)
            }
        )
        inverse.append(
            torch.stack(
                [torch.randint(0, max(bags[i][r], 1), (sizes[r],), generator=gen) for i in range(len(keys))]
            ).reshape(len(keys), sizes[r])
        )

    def build(ranks: List[int]) -> KeyedJaggedTensor:
        lengths = [len(b) for f in keys for r in ranks for b in rows[r][f]]
        values = [v for f in keys for r in ranks for b in rows[r][f] for v in b]
        shifted = [
            inverse[r]
            + torch.tensor([sum(bags[i][:r]) if len(ranks) > 1 else 0 for i in range(len(keys))]).unsqueeze(1)
            for r in ranks
        ]
        return KeyedJaggedTensor(
            keys,
            torch.tensor(values, dtype=torch.int64),
            lengths=torch.tensor(lengths, dtype=torch.int64),
            stride_per_key_per_rank=[[bags[i][r] for r in ranks] for i in range(len(keys))],
            inverse_indices=(keys, torch.cat(shifted, dim=1)),
        )

    return build(list(range(world_size))), build([rank]), sizes
