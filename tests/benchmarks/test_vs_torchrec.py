"""vs_torchrec's tables: one width, or several in turn (``--dims``), the same for both libraries."""

from __future__ import annotations

from benchmarks.vs_torchrec import _full_tables, table_dims


def test_tables_take_the_widths_in_turn_or_one_width():
    args = {"tables": 5, "rows": 7, "dim": 64, "dims": [16, 32]}
    assert table_dims(args) == [16, 32, 16, 32, 16]
    assert [tuple(w.shape) for w in _full_tables(args).values()] == [
        (7, 16),
        (7, 32),
        (7, 16),
        (7, 32),
        (7, 16),
    ]
    assert table_dims({**args, "dims": None}) == [64] * 5
