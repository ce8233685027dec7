"""``shardkit.huge_pages``: large fresh CPU buffers advised ``MADV_HUGEPAGE``, values untouched.

Whether the advice took effect is read from the kernel (``/proc/self/smaps``: the mapping holding the
buffer carries the ``hg`` VmFlag), so these tests fail if nothing is advised; they are skipped where
THP is off for the whole machine (``never``) or there is no ``/proc``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardkit import huge_pages
from shardkit.kernels import native_ops

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
thp_usable = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or not THP.exists()
    or "[never]" in THP.read_text()
    or not Path("/proc/self/smaps").exists(),
    reason="no transparent huge pages to advise here",
)


def _advised(address: int, pid: str = "self") -> bool:
    """Whether the mapping holding ``address`` has the ``hg`` (MADV_HUGEPAGE) flag."""
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _middle(t: torch.Tensor) -> int:
    return t.data_ptr() + t.numel() * t.element_size() // 2


@thp_usable
def test_a_large_buffer_is_advised_and_keeps_its_values():
    assert huge_pages.enabled()
    t = huge_pages.empty(64 << 20, dtype=torch.uint8)  # above glibc's mmap threshold: its own mapping
    assert _advised(_middle(t))
    t.fill_(3)
    assert int(t.sum()) == 3 * (64 << 20)
    like = torch.zeros(1, dtype=torch.float64)
    u = huge_pages.new_empty(like, 5, 2 << 20)
    assert u.dtype == torch.float64 and u.shape == (5, 2 << 20) and _advised(_middle(u))


@thp_usable
def test_small_and_plain_buffers_are_left_alone():
    small = huge_pages.empty(huge_pages.MIN_BYTES // 4 - 1, dtype=torch.float32)
    assert small.numel() * 4 < huge_pages.MIN_BYTES
    plain = torch.empty(64 << 20, dtype=torch.uint8)
    assert not _advised(_middle(plain))
    assert huge_pages.advise(plain) is plain and _advised(_middle(plain))


@thp_usable
@pytest.mark.skipif(native_ops() is None, reason="the native kernels do not build here")
def test_the_native_forward_advises_its_large_output():
    from shardkit.kernels.embedding import embedding_forward, kernel_backend

    weight = torch.randn(1000, 64)
    ids = torch.randint(0, 1000, (1 << 18,))
    offsets = torch.arange(0, ids.numel() + 1, 2)
    with kernel_backend("native"):
        out = embedding_forward(weight, ids, offsets, batch_major=1024)  # [1024, 128 * 64]: 32 MiB
    assert _advised(_middle(out))
    with kernel_backend("torch"):
        expected = embedding_forward(weight, ids, offsets, batch_major=1024)
    assert torch.equal(out, expected)


@thp_usable
def test_switched_off_by_the_environment():
    code = (
        f"import torch, sys; sys.path[:0] = {sys.path!r}\n"
        "from shardkit import huge_pages\n"
        "from shardkit.kernels import native_ops\n"
        "from shardkit.kernels.embedding import embedding_forward\n"
        "t = huge_pages.empty(64 << 20, dtype=torch.uint8)\n"
        "w = torch.randn(1000, 64); ids = torch.randint(0, 1000, (1 << 18,))\n"
        "o = embedding_forward(w, ids, torch.arange(0, ids.numel() + 1, 2), batch_major=1024)\n"
        "print(huge_pages.enabled(), native_ops() is not None)\n"
        "mid = lambda x: x.data_ptr() + x.numel() * x.element_size() // 2\n"
        "print(mid(t), mid(o), flush=True)\n"
        "sys.stdin.readline()\n"
    )
    env = dict(os.environ, SHARDKIT_HUGE_PAGES="0")
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        enabled, native = proc.stdout.readline().split()
        buffer, output = (int(x) for x in proc.stdout.readline().split())
        assert enabled == "False"
        assert not _advised(buffer, str(proc.pid))
        if native == "True":
            assert not _advised(output, str(proc.pid))
    finally:
        proc.communicate("\n", timeout=60)


@thp_usable
def test_cat_advises_large_results_only():
    big = [torch.full((6 << 20,), i, dtype=torch.uint8) for i in range(2)]
    out = huge_pages.cat(big)
    assert torch.equal(out, torch.cat(big)) and _advised(_middle(out))
    assert huge_pages.wanted(huge_pages.MIN_BYTES) and not huge_pages.wanted(huge_pages.MIN_BYTES - 1)
    small = [torch.arange(5, dtype=torch.int64), torch.arange(3, dtype=torch.int64)]
    assert torch.equal(huge_pages.cat(small), torch.cat(small))


@thp_usable
def test_embedding_tables_and_their_optimizer_state_are_advised():
    # the lookups read and update random rows: the table buffer (and a [rows, dim] optimizer state) of
    # a grouped lookup are advised when allocated (values as without the advice)
    from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig

    def collection(rows: int, optimizer: str) -> EmbeddingBagCollection:
        table = EmbeddingBagConfig(rows, 64, name="t", feature_names=["f"])
        return EmbeddingBagCollection([table], fused_optimizer=FusedOptimizerConfig(optimizer))

    large = collection(1 << 16, "ADAGRAD")  # 16 MiB of fp32 weights, the same of Adagrad sums
    (weight,) = large.parameters()
    (state,) = large.lookups[0].optimizer.buffers()
    assert state.shape == weight.shape
    assert _advised(_middle(weight)) and _advised(_middle(state))
    assert torch.isfinite(weight).all() and torch.equal(state, torch.zeros_like(state))
