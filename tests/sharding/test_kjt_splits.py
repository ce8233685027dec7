"""The KJT all-to-all's send plan: its per-(keys, splits) cache of checks, bounds and keys' fingerprint."""

from __future__ import annotations

import pytest
import torch

from shardkit.sharding.dist_data.kjt_splits import build_send_plan, fingerprint, header_rows
from shardkit.sparse import KeyedJaggedTensor


def _kjt(keys):
    n = len(keys)
    return KeyedJaggedTensor(keys, torch.arange(2 * n), lengths=torch.full((2 * n,), 1))


def test_plan_follows_the_keys_and_splits_of_each_call():
    abc = _kjt(["a", "b", "c"])
    first = build_send_plan(abc, [1, 2], 1, 2, 0)
    assert first.key_bounds == [0, 1, 3] and first.values == [2, 4]
    # same keys, other splits: other bounds (a cache keyed on the keys alone would repeat [0, 1, 3])
    assert build_send_plan(abc, [2, 1], 1, 2, 0).key_bounds == [0, 2, 3]
    # splits that were valid for these keys are not for others, and invalid ones raise every time
    with pytest.raises(ValueError, match="sum to 3, but the input has 2 keys"):
        build_send_plan(_kjt(["a", "b"]), [1, 2], 1, 2, 0)
    for _ in range(2):
        with pytest.raises(ValueError, match="negative"):
            build_send_plan(abc, [4, -1], 1, 2, 0)
    with pytest.raises(ValueError, match="2 entries for a group of 3"):
        build_send_plan(abc, [1, 2], 1, 3, 0)
    with pytest.raises(ValueError, match="stagger 3"):
        build_send_plan(abc, [1, 2], 3, 2, 0)
    # a plan's bounds are its own: mutating one does not change the next
    first.key_bounds.append(9)
    assert build_send_plan(abc, [1, 2], 1, 2, 0).key_bounds == [0, 1, 3]


def test_header_carries_the_fingerprint_of_this_calls_keys():
    for keys in (["a", "b", "c"], ["a", "c", "b"], ["x", "b", "c"]):
        plan = build_send_plan(_kjt(keys), [1, 2], 1, 2, 0)
        assert plan.keys_fingerprint == fingerprint(keys)
        assert header_rows(plan, 2, torch.device("cpu"))[:, 1].tolist() == [fingerprint(keys)] * 2
