"""The native row-wise bucketize against the pure-torch path, and against its definition."""

from __future__ import annotations

import pytest
import torch

from shardkit.kernels import bucketize_blocks, native_enabled_by_env

needs_native = pytest.mark.skipif(
    not native_enabled_by_env(), reason="SHARDKIT_NATIVE=0: the native kernels are switched off"
)


def _case(seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    bags = [5, 0, 7, 3]  # a feature with no bags, and uneven batch sizes
    lengths = torch.randint(0, 5, (sum(bags),), generator=gen)
    values = torch.randint(0, 100, (int(lengths.sum()),), generator=gen).to(dtype)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    # feature 0: 3 blocks, 1: 1 block, 2: 2 blocks, 3: 1 block; keys numbered rank by rank
    block_starts = [[0, 30, 70], [0], [0, 50], [0]]
    block_keys = [[0, 3, 5], [1], [2, 6], [4]]
    key_feature = [0, 1, 2, 0, 3, 0, 2]
    return values, offsets, bags, block_starts, block_keys, key_feature


def _by_definition(values, offsets, bags, block_starts, block_keys, key_feature):
    """Plain Python: every id's segment, then a stable sort."""
    key_bags = [bags[f] for f in key_feature]
    key_base = [sum(key_bags[:k]) for k in range(len(key_feature))]
    segments, bag, feature_first_bag = [], 0, [sum(bags[:f]) for f in range(len(bags))]
    off = offsets.tolist()
    for f, count in enumerate(bags):
        for _ in range(count):
            for i in range(off[bag], off[bag + 1]):
                # the last block starting at or before the id; the first block for smaller ids
                starts = block_starts[f]
                block = max((j for j, start in enumerate(starts) if start <= int(values[i])), default=0)
                segments.append(key_base[block_keys[f][block]] + bag - feature_first_bag[f])
            bag += 1
    order = sorted(range(len(segments)), key=lambda i: segments[i])
    lengths = [segments.count(s) for s in range(sum(key_bags))]
    return order, lengths


@pytest.mark.parametrize("backend", ["torch", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed", [0, 1])
def test_bucketize_matches_its_definition(backend, dtype, seed):
    case = _case(seed, dtype)
    order, lengths, sent = bucketize_blocks(*case, backend=backend)
    want_order, want_lengths = _by_definition(*case)
    assert order.tolist() == want_order
    assert lengths.tolist() == want_lengths
    assert sent.dtype == dtype and torch.equal(sent, case[0][order])


@pytest.mark.parametrize("backend", ["torch", pytest.param("native", marks=needs_native)])
def test_without_order_the_same_lengths_and_ids(backend):
    case = _case(0, torch.int64)
    order, lengths, sent = bucketize_blocks(*case, backend=backend)
    no_order, lengths2, sent2 = bucketize_blocks(*case, backend=backend, need_order=False)
    assert no_order is None
    assert torch.equal(lengths, lengths2) and torch.equal(sent, sent2)


def _random_case(seed: int, dtype: torch.dtype):
    """Many features of 1 to 4 blocks (empty bags, features without bags, ids below a block's start)."""
    gen = torch.Generator().manual_seed(seed)
    features = 9
    bags = torch.randint(0, 6, (features,), generator=gen).tolist()
    bags[3] = 0
    block_starts, block_keys, key_feature = [], [], []
    for f in range(features):
        count = int(torch.randint(1, 5, (1,), generator=gen))
        starts = sorted(torch.randperm(50, generator=gen)[: count - 1].add(1).tolist())
        block_starts.append([0, *starts] if f % 2 else [5, *[s + 5 for s in starts]])
        block_keys.append(list(range(len(key_feature), len(key_feature) + count)))
        key_feature += [f] * count
    # keys in a shuffled order (as rank by rank sends them), the blocks' keys renamed to match
    perm = torch.randperm(len(key_feature), generator=gen).tolist()
    block_keys = [[perm[k] for k in keys] for keys in block_keys]
    key_feature = [key_feature[perm.index(k)] for k in range(len(key_feature))]
    lengths = torch.randint(0, 6, (sum(bags),), generator=gen)
    values = torch.randint(0, 60, (int(lengths.sum()),), generator=gen).to(dtype)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return values, offsets, bags, block_starts, block_keys, key_feature


@pytest.mark.parametrize("backend", ["torch", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed", range(6))
def test_bucketize_random_features_match_the_definition(backend, dtype, seed):
    case = _random_case(seed, dtype)
    order, lengths, sent = bucketize_blocks(*case, backend=backend)
    want_order, want_lengths = _by_definition(*case)
    assert order.tolist() == want_order
    assert lengths.tolist() == want_lengths
    assert torch.equal(sent, case[0][order])


@needs_native
def test_native_refuses_blocks_that_share_a_segment():
    values, offsets, bags, block_starts, block_keys, key_feature = _case(0, torch.int64)
    block_keys = [[0, 3, 5], [1], [2, 6], [1]]  # features 1 and 3 both send under key 1
    with pytest.raises(RuntimeError, match="more than one block"):
        bucketize_blocks(values, offsets, bags, block_starts, block_keys, key_feature, backend="native")


@needs_native
def test_fixed_block_tensors_give_the_same_result_and_follow_the_batch_size():
    """One BlockTensors reused across calls whose batch sizes change (its per-batch tensors are
    remade) gives what the lists give on every call."""
    from shardkit.kernels.bucketize import BlockTensors

    base = _random_case(0, torch.int64)
    fixed = BlockTensors(base[3], base[4], base[5])
    gen = torch.Generator().manual_seed(3)
    for bags in (base[2], base[2], [b + 2 for b in base[2]], base[2]):
        lengths = torch.randint(0, 6, (sum(bags),), generator=gen)
        values = torch.randint(0, 60, (int(lengths.sum()),), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        case = (values, offsets, bags, *base[3:])
        got = bucketize_blocks(*case, backend="native", fixed=fixed)
        want = bucketize_blocks(*case, backend="native")
        want_order, want_lengths = _by_definition(*case)
        assert got[0].tolist() == want_order and got[1].tolist() == want_lengths
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_native
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("need_order", [True, False])
def test_two_block_features_match_the_torch_path(dtype, need_order):
    """Features of two blocks (a 2-rank row-wise plan: the native kernel's register-counted path)
    next to features of one and three blocks: ids below the first block, at the split and above it,
    bags long and empty, against the pure-torch path (and the order against the definition)."""
    gen = torch.Generator().manual_seed(7)
    bags = [40, 40, 0, 40, 40]
    block_starts = [[0, 500], [3, 250], [0, 10], [0], [0, 300, 600]]
    block_keys = [[0, 5], [1, 6], [2, 7], [3], [4, 8, 9]]
    key_feature = [0, 1, 2, 3, 4, 0, 1, 2, 4, 4]
    lengths = torch.randint(0, 60, (sum(bags),), generator=gen)
    lengths[::7] = 0
    values = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
    values[::5] = 500  # at the split of feature 0 (and above feature 1's)
    values[1::11] = 1  # below feature 1's first block
    values = values.to(dtype)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    case = (values, offsets, bags, block_starts, block_keys, key_feature)
    got = bucketize_blocks(*case, backend="native", need_order=need_order)
    want = bucketize_blocks(*case, backend="torch")
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert got[2].dtype == dtype
    if need_order:
        assert got[0].tolist() == _by_definition(*case)[0]


@needs_native
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("need_order", [True, False])
def test_features_of_three_to_nine_blocks_match_the_definition(dtype, need_order):
    """Features of 3 to 8 blocks (the kernel's branch-free paths, one per block count) and of 9 (its
    binary search), ids below the first block, at block starts and past the last, against the
    definition and the pure-torch path."""
    gen = torch.Generator().manual_seed(11)
    counts = [3, 4, 5, 6, 7, 8, 9]
    bags = [30] * len(counts)
    block_starts, block_keys, key_feature = [], [], []
    for f, count in enumerate(counts):
        block_starts.append([5 + 20 * j for j in range(count)])
        block_keys.append(list(range(len(key_feature), len(key_feature) + count)))
        key_feature += [f] * count
    lengths = torch.randint(0, 25, (sum(bags),), generator=gen)
    values = torch.randint(0, 200, (int(lengths.sum()),), generator=gen)
    values[::6] = 45  # a block start of every feature
    values = values.to(dtype)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    case = (values, offsets, bags, block_starts, block_keys, key_feature)
    got = bucketize_blocks(*case, backend="native", need_order=need_order)
    want = bucketize_blocks(*case, backend="torch")
    want_order, want_lengths = _by_definition(*case)
    assert got[1].tolist() == want_lengths and torch.equal(got[1], want[1])
    assert torch.equal(got[2], want[2]) and got[2].dtype == dtype
    if need_order:
        assert got[0].tolist() == want_order
