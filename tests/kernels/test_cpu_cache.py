"""The cache sizes the CPU loss kernels read (sysfs, sysconf, fallback) and the block sizes they derive."""

from __future__ import annotations

import pytest
import torch

from shardkit.kernels import cpu_cache
from shardkit.kernels.cpu_cache import (
    FALLBACK,
    CacheSizes,
    columns_in_cache,
    parse_size,
    rows_in_cache,
    sysfs_cache_sizes,
)
from shardkit.losses import statistics as st


def _fake_sysfs(root, entries):
    """``entries``: (level, type, size) per index directory, as Linux writes them."""
    for i, (level, kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return str(root)


def test_parse_size():
    assert parse_size("48K\n") == 48 * 1024
    assert parse_size("2048K") == 2 << 20
    assert parse_size("2M") == 2 << 20
    assert parse_size("512") == 512
    for bad in ("", "K", "abc", "-4K", "0K", "1.5M"):
        assert parse_size(bad) is None, bad


def test_sysfs_sizes_pick_the_data_and_unified_caches(tmp_path):
    # an Intel Xeon's layout: L1d, L1i, L2, L3 (the instruction cache must not be taken for L1)
    root = _fake_sysfs(
        tmp_path,
        [(1, "Data", "48K"), (1, "Instruction", "64K"), (2, "Unified", "2048K"), (3, "Unified", "491520K")],
    )
    assert sysfs_cache_sizes(root) == CacheSizes(l1d=48 * 1024, l2=2 << 20, source="sysfs")
    # instruction cache listed first, another L2 size (an AMD EPYC core's 1 MiB)
    root = _fake_sysfs(
        tmp_path / "b", [(1, "Instruction", "32K"), (1, "Data", "32K"), (2, "Unified", "1024K")]
    )
    assert sysfs_cache_sizes(root) == CacheSizes(l1d=32 * 1024, l2=1 << 20, source="sysfs")


def test_missing_or_invalid_sysfs_is_not_used(tmp_path):
    assert sysfs_cache_sizes(str(tmp_path / "absent")) is None
    assert sysfs_cache_sizes(_fake_sysfs(tmp_path / "no_l2", [(1, "Data", "32K")])) is None
    assert (
        sysfs_cache_sizes(_fake_sysfs(tmp_path / "bad", [(1, "Data", "32K"), (2, "Unified", "lots")])) is None
    )
    # an index directory without its files is skipped, not an error
    (tmp_path / "partial" / "index0").mkdir(parents=True)
    root = _fake_sysfs(tmp_path / "partial2", [(1, "Data", "32K"), (2, "Unified", "512K")])
    assert sysfs_cache_sizes(root).l2 == 512 * 1024


def test_cache_sizes_fall_back_in_order(monkeypatch):
    cpu_cache.cache_sizes.cache_clear()
    try:
        monkeypatch.setattr(cpu_cache, "sysfs_cache_sizes", lambda: None)
        monkeypatch.setattr(cpu_cache, "sysconf_cache_sizes", lambda: CacheSizes(1024, 4096, "sysconf"))
        assert cpu_cache.cache_sizes().source == "sysconf"
        cpu_cache.cache_sizes.cache_clear()
        monkeypatch.setattr(cpu_cache, "sysconf_cache_sizes", lambda: None)
        assert cpu_cache.cache_sizes() == FALLBACK
    finally:
        cpu_cache.cache_sizes.cache_clear()


def test_this_machine_has_sizes():
    sizes = cpu_cache.cache_sizes()
    assert sizes.l1d > 0 and sizes.l2 >= sizes.l1d


@pytest.mark.parametrize("l2", [256 * 1024, 1 << 20, 2 << 20, 4 << 20, 32 << 20])
@pytest.mark.parametrize("width", [1000, 32000, 64000, 256000])
def test_block_rows_keep_the_working_set_within_half_the_l2(l2, width):
    row_bytes = width * 8  # fp32 source + fp32 work
    rows = rows_in_cache(row_bytes, l2, limit=1 << 20)
    assert rows >= 1
    assert rows == 1 or rows * row_bytes <= l2 // 2
    assert (rows + 1) * row_bytes > l2 // 2  # the largest such block
    assert rows_in_cache(row_bytes, l2, limit=3) <= 3


@pytest.mark.parametrize("l2", [1 << 20, 2 << 20, 8 << 20])
def test_statistics_blocks_follow_the_machine_l2(monkeypatch, l2):
    monkeypatch.setattr(st, "cache_sizes", lambda: CacheSizes(l1d=32 * 1024, l2=l2, source="test"))
    for width, item in ((64000, 4), (64000, 2), (1000, 4)):
        rows = st.cache_rows(width, 4096, torch.device("cpu"), item)
        assert rows == 1 or rows * width * (item + 4) <= l2 // 2
        assert rows == 4096 or (rows + 1) * width * (item + 4) > l2 // 2  # the largest such block
    # not on CPU: the chunk bound alone
    assert st.cache_rows(64000, 123, torch.device("meta")) == 123


def test_chunk_columns_fit_half_the_l1d():
    assert columns_in_cache(4, 48 * 1024) == 6144
    assert columns_in_cache(2, 48 * 1024) == 12288
    assert columns_in_cache(4, 32 * 1024) * 4 <= 16 * 1024
    assert columns_in_cache(4, 100) == 256  # never below the minimum
