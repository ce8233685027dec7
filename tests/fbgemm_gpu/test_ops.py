"""fbgemm's jagged ops on shardkit's jagged code (shardkit.fbgemm_gpu.ops), against plain-torch loop
references, and their registration as torch.ops.fbgemm (only by importing shardkit.fbgemm_gpu.torch_ops,
which the run-as-torchrec mode does)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from shardkit.fbgemm_gpu import ops


def _offsets(lengths, dtype=torch.int64):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=dtype)


def _ref_jagged_2d_to_dense(values, lengths, max_len):
    """One row at a time: the row's first ``max_len`` values, zero padded."""
    rows, start = [], 0
    for n in lengths:
        row = values[start : start + min(n, max_len)]
        rows.append(F.pad(row, (0, 0, 0, max_len - row.size(0))))
        start += n
    return torch.stack(rows) if rows else values.new_zeros(0, max_len, values.size(1))


def _ref_dense_to_jagged(dense, lengths):
    """One row at a time: the row's first ``n`` positions; positions past the dense length are 0."""
    parts = []
    for b, n in enumerate(lengths):
        row = dense[b, : min(n, dense.size(1))]
        parts.append(F.pad(row, (0, 0, 0, n - row.size(0))))
    return torch.cat(parts) if parts else dense.new_zeros(0, dense.size(2))


CASES = [([2, 0, 3, 1], 2), ([2, 0, 3, 1], 5), ([0, 0, 0], 3), ([4], 0), ([], 2), ([1, 1, 1], 1)]


@pytest.mark.parametrize("lengths, max_len", CASES)
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_jagged_2d_to_dense_matches_a_loop(lengths, max_len, offsets_dtype):
    torch.manual_seed(0)
    values = torch.randn(sum(lengths), 3, dtype=torch.float64, requires_grad=True)
    ref_values = values.detach().clone().requires_grad_()
    got = ops.jagged_2d_to_dense(values, _offsets(lengths, offsets_dtype), max_len)
    want = _ref_jagged_2d_to_dense(ref_values, lengths, max_len)
    assert got.shape == (len(lengths), max_len, 3)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if lengths:  # (the loop reference of an empty batch has no graph)
        grad = torch.randn_like(want)
        got.backward(grad)
        want.backward(grad)
        torch.testing.assert_close(values.grad, ref_values.grad, rtol=0, atol=0)


@pytest.mark.parametrize("lengths, dense_len", CASES)
@pytest.mark.parametrize("give_total", [True, False])
def test_dense_to_jagged_matches_a_loop(lengths, dense_len, give_total):
    torch.manual_seed(1)
    dense = torch.randn(len(lengths), dense_len, 2, dtype=torch.float64, requires_grad=True)
    ref_dense = dense.detach().clone().requires_grad_()
    offsets = _offsets(lengths)
    values, out_offsets = ops.dense_to_jagged(dense, [offsets], sum(lengths) if give_total else None)
    want = _ref_dense_to_jagged(ref_dense, lengths)
    torch.testing.assert_close(values, want, rtol=0, atol=0)
    assert len(out_offsets) == 1 and torch.equal(out_offsets[0], offsets)
    if values.numel():
        grad = torch.randn_like(want)
        values.backward(grad)
        want.backward(grad)
        torch.testing.assert_close(dense.grad, ref_dense.grad, rtol=0, atol=0)


def test_dense_to_jagged_undoes_jagged_2d_to_dense_when_rows_fit():
    lengths = [2, 0, 3]
    values = torch.arange(10.0).view(5, 2)
    offsets = _offsets(lengths)
    dense = ops.jagged_2d_to_dense(values, offsets, 3)
    assert torch.equal(ops.dense_to_jagged(dense, [offsets])[0], values)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_complete_exclusive_inclusive_cumsums(dtype):
    lengths = torch.tensor([3, 0, 2, 5], dtype=dtype)
    complete = ops.asynchronous_complete_cumsum(lengths)
    assert complete.dtype == dtype and complete.tolist() == [0, 3, 3, 5, 10]
    assert ops.asynchronous_exclusive_cumsum(lengths).tolist() == [0, 3, 3, 5]
    assert ops.asynchronous_inclusive_cumsum(lengths).tolist() == [3, 3, 5, 10]
    assert ops.asynchronous_complete_cumsum(lengths[:0]).tolist() == [0]
    two_d = torch.tensor([[1, 2, 3], [0, 4, 0]], dtype=dtype)
    got = ops.asynchronous_complete_cumsum(two_d)
    want = torch.stack([torch.tensor([0] + row.cumsum(0).tolist(), dtype=dtype) for row in two_d])
    assert got.dtype == dtype and torch.equal(got, want)


def test_bad_inputs_are_errors_naming_the_op_and_shapes():
    offsets = _offsets([1, 2])
    with pytest.raises(
        ValueError, match=r"jagged_2d_to_dense: values must be 2-D \[N, D\], got shape \(3,\)"
    ):
        ops.jagged_2d_to_dense(torch.zeros(3), offsets, 2)
    with pytest.raises(ValueError, match="max_sequence_length must be >= 0, got -1"):
        ops.jagged_2d_to_dense(torch.zeros(3, 1), offsets, -1)
    with pytest.raises(ValueError, match=r"offsets must be 1-D \[B \+ 1\], got shape \(1, 3\)"):
        ops.jagged_2d_to_dense(torch.zeros(3, 1), offsets.view(1, 3), 2)
    with pytest.raises(ValueError, match="one jagged dimension .* got 2"):
        ops.dense_to_jagged(torch.zeros(2, 2, 1), [offsets, offsets])
    with pytest.raises(ValueError, match=r"B = len\(offsets\) - 1 = 2, got shape \(3, 2, 1\)"):
        ops.dense_to_jagged(torch.zeros(3, 2, 1), [offsets])
    with pytest.raises(ValueError, match=r"1-D or 2-D tensor, got shape \(1, 1, 1\)"):
        ops.asynchronous_complete_cumsum(torch.zeros(1, 1, 1))


REGISTRATION = textwrap.dedent(
    """
    import torch
    import shardkit.fbgemm_gpu.ops as ops
    names = ["jagged_2d_to_dense", "dense_to_jagged", "asynchronous_complete_cumsum",
             "asynchronous_inclusive_cumsum", "asynchronous_exclusive_cumsum"]
    print([torch._C._dispatch_has_kernel("fbgemm::" + n) for n in names], ops.registered())
    import shardkit.fbgemm_gpu.torch_ops
    print([torch._C._dispatch_has_kernel("fbgemm::" + n) for n in names], ops.registered())
    values = torch.arange(6.0).view(3, 2).requires_grad_()
    offsets = torch.tensor([0, 2, 2, 3])
    dense = torch.ops.fbgemm.jagged_2d_to_dense(values=values, offsets=offsets, max_sequence_length=2)
    assert torch.equal(dense, ops.jagged_2d_to_dense(values, offsets, 2))
    dense.sum().backward()
    assert values.grad.tolist() == [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    jagged, out_offsets = torch.ops.fbgemm.dense_to_jagged(dense, [offsets], total_L=3)
    assert torch.equal(jagged, values) and torch.equal(out_offsets[0], offsets)
    assert torch.ops.fbgemm.asynchronous_complete_cumsum(torch.tensor([2, 0, 1])).tolist() == [0, 2, 2, 3]
    ops.register()  # idempotent
    print("ok")
    """
)


def test_the_ops_are_registered_only_by_importing_torch_ops():
    done = subprocess.run([sys.executable, "-c", REGISTRATION], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "[False, False, False, False, False] False",
        "[True, True, True, True, True] True",
        "ok",
    ]
