"""The sweep's grid is the covering design its docstring states (no torchrec needed)."""

from collections import Counter
from itertools import product

import torch
from benchmarks.vs_torchrec import _batches
from benchmarks.vs_torchrec_sweep import (
    BATCHES,
    DEFAULT_BUDGET,
    DIMS,
    OPTIMIZERS,
    TABLE_COUNTS,
    TYPES,
    grid,
    schedule,
)

from shardkit.cli.bench import QUICK_ARGS


def test_batch_tables_and_type_are_crossed_fully_and_each_type_sees_every_dim_and_optimizer():
    rows = grid()
    cells = Counter((r["batch"], r["tables"], r["kind"]) for r in rows)
    assert set(cells) == set(product(BATCHES, TABLE_COUNTS, TYPES)) and set(cells.values()) == {1}
    for kind in TYPES:
        pairs = {(r["dim"], r["optimizer"]) for r in rows if r["kind"] == kind}
        assert pairs == set(product(DIMS, OPTIMIZERS)), kind
    for a, b in [("batch", "dim"), ("batch", "optimizer"), ("tables", "dim"), ("tables", "optimizer")]:
        assert {(r[a], r[b]) for r in rows} == set(product({r[a] for r in rows}, {r[b] for r in rows}))


def test_table_sizes_span_1e3_to_1e6_within_the_memory_budget():
    rows = grid()
    assert min(min(r["table_rows"]) for r in rows) == 1_000
    assert max(max(r["table_rows"]) for r in rows) == 1_000_000
    for r in rows:
        assert len(r["table_rows"]) == r["tables"] and r["table_rows"] == sorted(r["table_rows"])
        assert sum(r["table_rows"]) * r["dim"] <= DEFAULT_BUDGET


def test_quick_is_one_row_per_batch_tables_cell_of_the_full_grid_with_every_type():
    quick, full = grid(quick=True), grid()
    assert all(r in full for r in quick)
    assert sorted((r["batch"], r["tables"]) for r in quick) == sorted(product(BATCHES, TABLE_COUNTS))
    assert {r["kind"] for r in quick} == set(TYPES)
    assert {r["dim"] for r in quick} == set(DIMS) and {r["optimizer"] for r in quick} == set(OPTIMIZERS)
    assert QUICK_ARGS["vs_torchrec_sweep"] == ["--quick"]


def test_batches_draw_each_feature_s_ids_within_its_own_table():
    args = {"tables": 3, "batch": 5, "pooling": 4, "table_rows": [10, 1000, 3]}
    for values, lengths in _batches(args, rank=0, count=3):
        assert lengths.numel() == 15 and int(lengths.sum()) == values.numel()
        per_key = values.split(lengths.view(3, 5).sum(1).tolist())
        for ids, rows in zip(per_key, args["table_rows"]):
            assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < rows


def test_every_library_runs_at_least_min_steps_timed_steps_and_short_steps_keep_the_time_budget():
    # a step as long as a round: 1 step a round, as many rounds as min_steps asks (was 2 rounds)
    assert schedule(1.27, rounds=6, round_s=0.5, min_steps=6) == (1, 6)
    assert schedule(2.45, rounds=6, round_s=0.5, min_steps=6) == (1, 6)
    assert schedule(0.2, rounds=4, round_s=0.25, min_steps=5) == (1, 5)
    # short steps: the rounds asked for, about round_s each, min_steps already met
    assert schedule(0.005, rounds=6, round_s=0.5, min_steps=6) == (100, 6)
    assert schedule(0.001, rounds=4, round_s=0.5, min_steps=6) == (200, 4)
    for probe in (0.001, 0.01, 0.07, 0.3, 0.9, 4.0):
        iters, rounds = schedule(probe, rounds=6, round_s=0.5, min_steps=6)
        assert iters >= 1 and rounds >= 2 and iters * rounds >= 6
        assert iters * probe * rounds <= max(6 * 0.5 * 1.5, 6 * probe)  # near the budget, or min_steps
