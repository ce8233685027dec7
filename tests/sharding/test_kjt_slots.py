"""The KJT all-to-all's tensors travel in the header's slot (``kjt_slots``): one collective per exchange
once the slots are sized, a second one on every rank when any rank's payload outgrows them (also when
only one rank's does), none of the slot machinery when payloads exceed ``LIMIT``; the output is the
plain-Python model's in every case."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.sharding.dist_data import KJTAllToAll, kjt_all_to_all, kjt_slots
from shardkit.sharding.dist_data.kjt_slots import SlotCapacity
from tests.sharding._inputs import KEYS, batches, build_kjt, input_rows, splits_for


def _counting(made: list, inner):
    """The all-to-all the exchange starts, appending to ``made`` per call."""

    def counted(*args, **kwargs):
        made.append(1)
        return inner(*args, **kwargs)

    return counted


def _exchange(a2a, splits, mode, weighted, scale_of):
    """One exchange of every rank's rows (rank ``s``'s batch scaled by ``scale_of(s)``), checked
    against the model: each of this rank's keys gets every source rank's rows in rank order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    inputs = [input_rows(s, [b * scale_of(s) for b in batches(s, mode)]) for s in range(world)]
    out = a2a(build_kjt(inputs[rank], mode, weighted)).wait().wait()
    start = sum(splits[:rank])
    mine = KEYS[start : start + splits[rank]]
    assert out.keys() == mine
    rows = [row for k in mine for s in range(world) for row in inputs[s][k]]
    assert out.lengths().tolist() == [len(r) for r in rows]
    assert out.values().tolist() == [v for r in rows for v in r]
    if weighted:
        assert torch.equal(out.weights(), out.values().to(torch.float64) / 7)
    if mode == "variable":
        assert out.stride_per_key_per_rank() == [[len(inputs[s][k]) for s in range(world)] for k in mine]


# (mode, weighted, scale of rank 0's batch, scale of the others', collectives expected or None)
SEQUENCE = [
    ("equal", False, 1, 1, 2),  # no capacity yet: header, then the tensors
    ("equal", False, 1, 1, 1),  # sized by the first: everything in the slots
    ("equal", True, 1, 1, None),  # weighted: fits or not, the output must be right
    ("uneven", True, 1, 1, None),
    ("equal", False, 8, 8, 2),  # every payload outgrew the slots
    ("equal", False, 8, 8, 1),
    ("variable", True, 1, 1, None),
    ("equal", False, 40, 1, 2),  # only rank 0's payload outgrew them: every rank makes the second one
    ("equal", False, 1, 1, 1),
    ("equal", False, 0, 0, 1),  # empty batches
]


def _slots_worker(limit):
    # the workers are reused by later tests: the patched names are restored
    inner, old_limit = kjt_all_to_all.all_to_all_single, kjt_slots.LIMIT
    made: list = []
    kjt_all_to_all.all_to_all_single = kjt_slots.all_to_all_single = _counting(made, inner)
    kjt_slots.LIMIT = old_limit if limit is None else limit
    try:
        counts = []
        for splits in splits_for(dist.get_world_size()):
            a2a = KJTAllToAll(None, splits)
            for mode, weighted, first, others, _ in SEQUENCE:
                before = len(made)
                _exchange(a2a, splits, mode, weighted, lambda s, f=first, o=others: f if s == 0 else o)
                counts.append(len(made) - before)
        return counts
    finally:
        kjt_all_to_all.all_to_all_single = kjt_slots.all_to_all_single = inner
        kjt_slots.LIMIT = old_limit


@pytest.mark.parametrize("world", [2, 3])
def test_tensors_ride_in_the_slots(world, run_world):
    results = run_world(_slots_worker, world, None)
    assert all(counts == results[0] for counts in results)  # every rank made the same collectives
    expected = [c for _ in splits_for(world) for *_, c in SEQUENCE]
    assert [c for c, e in zip(results[0], expected) if e is not None] == [
        e for e in expected if e is not None
    ]


def test_payloads_over_the_limit_take_two_collectives(run_world):
    results = run_world(_slots_worker, 2, 0)
    # no slot capacity ever: two collectives per exchange, but one for empty batches (nothing to send)
    expected = [
        1 if first == 0 and others == 0 else 2 for _ in splits_for(2) for _, _, first, others, _ in SEQUENCE
    ]
    assert results[0] == results[1] == expected


def test_refit_rounds_up_and_stops_at_the_limit():
    slots = SlotCapacity()
    assert slots.capacity == 0
    slots.refit(1000)
    assert slots.capacity % 8 == 0 and slots.capacity >= 1250
    slots.refit(kjt_slots.LIMIT + 1)
    assert slots.capacity == 0
    assert torch.equal(slots.zeros(24, torch.device("cpu")), torch.zeros(24, dtype=torch.uint8))
