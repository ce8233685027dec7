"""How the native CE gradient maps the pages of its fresh output buffer (``SHARDKIT_CE_PAGES``).

"populate" (one ``madvise(MADV_POPULATE_WRITE)`` per row, Linux >= 5.14) and "touch" (a store per
4 KiB page) must give bitwise the same gradient as writing into a buffer whose pages are already
mapped; the choice from the environment and the platform is tested with fake ones. Transparent huge
pages are never requested, so THP's setting ("never", "madvise", "always") changes no result.
"""

from __future__ import annotations

import platform
import re
import sys

import pytest
import torch

from shardkit.kernels import cross_entropy as kce
from shardkit.kernels import native_ops

needs_native = pytest.mark.skipif(native_ops() is None, reason="the native kernels do not build here")


def test_requested_mode_follows_the_platform_when_unset():
    assert kce.requested_page_mode({}, "linux") == "populate"
    assert kce.requested_page_mode({kce.PAGES_ENV: " "}, "linux") == "populate"
    for other in ("darwin", "win32", "freebsd14"):
        assert kce.requested_page_mode({}, other) == "touch"


def test_requested_mode_from_the_environment():
    assert kce.requested_page_mode({kce.PAGES_ENV: "touch"}, "linux") == "touch"
    assert kce.requested_page_mode({kce.PAGES_ENV: " Populate "}, "linux") == "populate"
    # asked for on a platform without madvise: the kernel falls back to touching (see below)
    assert kce.requested_page_mode({kce.PAGES_ENV: "populate"}, "darwin") == "populate"
    with pytest.raises(ValueError, match=f"{kce.PAGES_ENV}='huge'"):
        kce.requested_page_mode({kce.PAGES_ENV: "huge"}, "linux")


@pytest.fixture
def ops():
    ops = native_ops()
    before = ops.ce_fault_mode(-1)
    yield ops
    ops.ce_fault_mode(before)


def _gradient_args(dtype, rows, width, real):
    gen = torch.Generator().manual_seed(7)
    x = (3 * torch.randn(rows, width, generator=gen)).to(dtype)
    lse = torch.logsumexp(x[:, :real].float(), 1).contiguous()
    coef_p = torch.rand(rows, generator=gen).contiguous()
    index = torch.randint(0, width, (rows,), generator=gen)
    minus_target = torch.where(index < real, -coef_p, torch.zeros_like(coef_p)).contiguous()
    active = torch.rand(rows, generator=gen) > 0.1
    return x, lse, coef_p, minus_target, index, active


@needs_native
@pytest.mark.parametrize("in_dtype,out_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2,
                                                (torch.bfloat16, torch.float32)])  # fmt: skip
def test_page_modes_write_every_element_and_agree(ops, in_dtype, out_dtype):
    # 6 MB of fp32 output (above malloc's mmap threshold: fresh pages); 3001-column rows start at
    # every offset within a page and cross page boundaries; padding columns (real < width) and
    # inactive rows are written too
    rows, width, real = 500, 3001, 2990
    x, lse, coef_p, minus_target, index, active = _gradient_args(in_dtype, rows, width, real)
    args = (lse, coef_p, minus_target, None, index, active, real, 1.0)
    mapped = torch.full((rows, width), float("nan"), dtype=out_dtype)  # pages present; NaN shows a gap
    expected = ops.ce_gradient(x, mapped, *args).clone()
    assert not expected.isnan().any()
    assert torch.all(expected[~active] == 0) and torch.all(expected[:, real:] == 0)
    for mode in (0, 1, 0):
        ops.ce_fault_mode(mode)
        fresh = torch.empty(rows, width, dtype=out_dtype)
        assert torch.equal(ops.ce_gradient(x, fresh, *args), expected), f"mode {mode}"


@needs_native
def test_in_place_gradient_is_unchanged_by_the_mode(ops):
    rows, width, real = 300, 3001, 3001
    x, lse, coef_p, minus_target, index, active = _gradient_args(torch.float32, rows, width, real)
    args = (lse, coef_p, minus_target, None, index, active, real, 1.0)
    expected = ops.ce_gradient(x, torch.empty_like(x), *args)
    for mode in (0, 1):
        ops.ce_fault_mode(mode)
        y = x.clone()
        assert torch.equal(ops.ce_gradient(y, y, *args), expected)


def _kernel_version():
    found = re.match(r"(\d+)\.(\d+)", platform.release())
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


@needs_native
@pytest.mark.skipif(not sys.platform.startswith("linux") or _kernel_version() < (5, 14),
                    reason="MADV_POPULATE_WRITE needs Linux >= 5.14")  # fmt: skip
def test_populate_really_runs_here(ops):
    # the kernel drops to "touch" for good when madvise fails: after a fresh gradient, the mode must
    # still be "populate" on a kernel that has MADV_POPULATE_WRITE
    ops.ce_fault_mode(1)
    x, lse, coef_p, minus_target, index, active = _gradient_args(torch.float32, 400, 4096, 4096)
    ops.ce_gradient(x, torch.empty_like(x), lse, coef_p, minus_target, None, index, active, 4096, 1.0)
    assert kce.gradient_page_mode(ops) == "populate"


@needs_native
def test_mode_argument_is_checked(ops):
    with pytest.raises(RuntimeError, match="requested must be"):
        ops.ce_fault_mode(2)
