"""The cache sizes the CPU loss kernels read (sysfs, sysconf, fallback) and the block sizes they derive."""

from __future__ import annotations

import sys

import pytest
import torch

from shardkit.kernels import cpu_cache
from shardkit.kernels.cpu_cache import (
    FALLBACK,
    OVERRIDE_ENV,
    CacheSizes,
    columns_in_cache,
    override_sizes,
    parse_size,
    rows_in_cache,
    sysfs_cache_sizes,
)
from shardkit.losses import cross_entropy as ce
from shardkit.losses import statistics as st


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    # the machine's own sizes unless a test sets the override; every test starts and ends uncached
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    cpu_cache.cache_sizes.cache_clear()
    yield
    cpu_cache.cache_sizes.cache_clear()


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


# cpu0's cache/index* entries as Linux writes them on other x86 server CPUs (L3: one per CCX / CCD on
# AMD, listed last and never read)
OTHER_CPUS = {
    "AMD EPYC Zen 2 (Rome)": (
        [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "512K"), (3, "Unified", "16384K")],
        32 << 10,
        512 << 10,
    ),
    "AMD EPYC Zen 4 (Genoa)": (
        [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"), (3, "Unified", "32768K")],
        32 << 10,
        1 << 20,
    ),
    "AMD EPYC Zen 5 (Turin)": (
        [(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"), (3, "Unified", "32768K")],
        48 << 10,
        1 << 20,
    ),
    "Intel Xeon Ice Lake-SP": (
        [(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "1280K"), (3, "Unified", "49152K")],
        48 << 10,
        1280 << 10,
    ),
    "Intel Xeon Skylake-SP": (
        [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"), (3, "Unified", "39424K")],
        32 << 10,
        1 << 20,
    ),
}


@pytest.mark.parametrize("cpu", sorted(OTHER_CPUS))
def test_sysfs_sizes_of_other_x86_server_cpus(tmp_path, cpu):
    entries, l1d, l2 = OTHER_CPUS[cpu]
    assert sysfs_cache_sizes(_fake_sysfs(tmp_path, entries)) == CacheSizes(l1d, l2, "sysfs")
    # and the native statistics chunk follows the L1d: half of it, a multiple of 64 columns
    assert columns_in_cache(4, l1d) == l1d // 8 and columns_in_cache(2, l1d) == l1d // 4


def test_an_l2_below_the_l1d_is_not_believed(tmp_path, monkeypatch):
    # e.g. a hypervisor that reports a bogus L2: the pair is not used, the next source answers
    bogus = _fake_sysfs(tmp_path, [(1, "Data", "48K"), (2, "Unified", "16K")])
    assert sysfs_cache_sizes(bogus) is None
    sysconf = {"SC_LEVEL1_DCACHE_SIZE": 32 << 10, "SC_LEVEL2_CACHE_SIZE": 4 << 10}
    monkeypatch.setattr(cpu_cache.os, "sysconf_names", dict.fromkeys(sysconf, 0))
    monkeypatch.setattr(cpu_cache.os, "sysconf", sysconf.__getitem__)
    assert cpu_cache.sysconf_cache_sizes() is None


def test_sysconf_by_glibc_number_where_python_lacks_the_names(monkeypatch):
    # CPython's os.sysconf_names has no SC_LEVEL*_CACHE names: by name, this source never answered
    asked = []

    def sysconf(code):
        asked.append(code)
        return {188: 48 << 10, 191: 2 << 20}[code]

    monkeypatch.setattr(cpu_cache.os, "sysconf_names", {})
    monkeypatch.setattr(cpu_cache.os, "sysconf", sysconf)
    monkeypatch.setattr(cpu_cache, "_is_glibc", lambda: True)
    assert cpu_cache.sysconf_cache_sizes() == CacheSizes(48 << 10, 2 << 20, "sysconf")
    assert asked == [188, 191]
    # not glibc (musl, macOS): the numbers mean nothing there, so they are never asked
    asked.clear()
    monkeypatch.setattr(cpu_cache, "_is_glibc", lambda: False)
    assert cpu_cache.sysconf_cache_sizes() is None and asked == []


@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and cpu_cache._is_glibc()), reason="glibc's sysconf only"
)
def test_sysconf_answers_on_this_glibc_machine():
    # where sysfs has no cache entries (some containers and VMs), this is the source that answers
    sizes = cpu_cache.sysconf_cache_sizes()
    assert sizes is not None and 0 < sizes.l1d <= sizes.l2


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
    # e.g. a container or VM without cpu0's sysfs cache entries (sysconf asks CPUID), then neither
    monkeypatch.setattr(cpu_cache, "sysfs_cache_sizes", lambda: None)
    monkeypatch.setattr(cpu_cache, "sysconf_cache_sizes", lambda: CacheSizes(1024, 4096, "sysconf"))
    assert cpu_cache.cache_sizes().source == "sysconf"
    cpu_cache.cache_sizes.cache_clear()
    monkeypatch.setattr(cpu_cache, "sysconf_cache_sizes", lambda: None)
    assert cpu_cache.cache_sizes() == FALLBACK


def test_override_parses_and_names_what_is_wrong():
    assert override_sizes("l1d=32K,l2=512K") == {"l1d": 32 << 10, "l2": 512 << 10}
    assert override_sizes(" L2 = 2M ") == {"l2": 2 << 20}
    assert override_sizes("l1d=49152,") == {"l1d": 48 << 10}
    for bad, why in (
        ("l3=32M", "'l3=32M' is not"),
        ("l1d=32K,l2=lots", "'l2=lots' is not"),
        ("l1d", "'l1d' is not"),
        ("l2=0", "'l2=0' is not"),
        ("l2=1M,l2=2M", "l2 is given twice"),
        (" , ", "names no size"),
    ):
        with pytest.raises(ValueError, match=OVERRIDE_ENV) as info:
            override_sizes(bad)
        assert why in str(info.value), (bad, str(info.value))


def test_override_replaces_the_detected_sizes(monkeypatch):
    detected = CacheSizes(48 << 10, 2 << 20, "sysfs")
    monkeypatch.setattr(cpu_cache, "detected_cache_sizes", lambda: detected)
    assert cpu_cache.cache_sizes() == detected
    monkeypatch.setenv(OVERRIDE_ENV, "l1d=32K,l2=512K")
    cpu_cache.cache_sizes.cache_clear()
    assert cpu_cache.cache_sizes() == CacheSizes(32 << 10, 512 << 10, OVERRIDE_ENV)
    # one key: the other is the detected one
    monkeypatch.setenv(OVERRIDE_ENV, "l2=256K")
    cpu_cache.cache_sizes.cache_clear()
    assert cpu_cache.cache_sizes() == CacheSizes(48 << 10, 256 << 10, OVERRIDE_ENV)
    # a bad value is an error naming the variable, not a silent fallback
    monkeypatch.setenv(OVERRIDE_ENV, "l2=big")
    cpu_cache.cache_sizes.cache_clear()
    with pytest.raises(ValueError, match=OVERRIDE_ENV):
        cpu_cache.cache_sizes()


class _RecordingOps:
    """Stands in for the native ops: records the chunk the statistics are asked to use."""

    def __init__(self):
        self.chunks = []

    def ce_statistics(self, logits2d, index, owned, real, inv_t, with_sum, chunk):
        self.chunks.append(chunk)
        return torch.zeros(logits2d.size(0), 3)


@pytest.mark.parametrize(("value", "fp32", "bf16"), [("l1d=32K", 4096, 8192), ("l1d=48K", 6144, 12288)])
def test_the_native_statistics_chunk_follows_the_override(monkeypatch, value, fp32, bf16):
    # the block the loss actually passes to the kernel, not only the rule's arithmetic
    monkeypatch.setenv(OVERRIDE_ENV, value)
    ops = _RecordingOps()
    target = torch.zeros(2, dtype=torch.long)
    owned = torch.ones(2, dtype=torch.bool)
    opts = ce.prepare_cross_entropy("test", torch.zeros(2, 64000), target, None, 0, 64000)[2]
    for dtype in (torch.float32, torch.bfloat16):
        ce.native_statistics(ops, torch.zeros(2, 64000, dtype=dtype), target, owned, opts)
    assert ops.chunks == [fp32, bf16]


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
