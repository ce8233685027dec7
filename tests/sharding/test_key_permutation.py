"""KeyPermutation.apply is KeyedJaggedTensor.permute, by the native segment kernel where it can run."""

from __future__ import annotations

import pytest
import torch

from shardkit.kernels import kernel_backend, native_ops
from shardkit.sharding.key_permutation import KeyPermutation
from shardkit.sparse import KeyedJaggedTensor

PERM = [2, 0, 3, 1]


def _kjt(batch: int, lengths_dtype=torch.int64, weighted: bool = False) -> KeyedJaggedTensor:
    torch.manual_seed(batch)
    lengths = torch.randint(0, 4, (4 * batch,), dtype=lengths_dtype)
    values = torch.randint(0, 100, (int(lengths.sum()),))
    weights = torch.rand(values.numel(), dtype=torch.float64) if weighted else None
    return KeyedJaggedTensor(["a", "b", "c", "d"], values, weights, lengths=lengths, stride=batch)


def _same(got: KeyedJaggedTensor, expected: KeyedJaggedTensor) -> None:
    assert got.keys() == expected.keys() and got.stride() == expected.stride()
    assert torch.equal(got.values(), expected.values()) and torch.equal(got.lengths(), expected.lengths())
    assert got.lengths().dtype == expected.lengths().dtype
    assert got.length_per_key() == expected.length_per_key()
    if expected.weights_or_none() is None:
        assert got.weights_or_none() is None
    else:
        assert torch.equal(got.weights(), expected.weights())


def _no_permute(*args, **kwargs):
    raise AssertionError("KeyedJaggedTensor.permute called: the native path did not run")


@pytest.mark.skipif(native_ops() is None, reason="needs the native kernels")
@pytest.mark.parametrize("batch", [0, 1, 5])
@pytest.mark.parametrize("lengths_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("weighted", [False, True])
def test_native_path_is_permute(monkeypatch, batch, lengths_dtype, weighted):
    kjt = _kjt(batch, lengths_dtype, weighted)
    expected = kjt.permute(PERM)
    permutation = KeyPermutation(PERM)
    monkeypatch.setattr(KeyedJaggedTensor, "permute", _no_permute)
    _same(permutation.apply(kjt), expected)
    _same(permutation.apply(kjt), expected)  # the cached index tensors again


def test_other_cases_go_through_permute():
    kjt = _kjt(3, weighted=True)
    # not a permutation (a key repeated, one dropped), or another backend forced: permute itself
    for indices in ([0, 0, 2, 3], [1, 2]):
        _same(KeyPermutation(indices).apply(kjt), kjt.permute(indices))
    with kernel_backend("torch"):
        _same(KeyPermutation(PERM).apply(kjt), kjt.permute(PERM))
    # weights that need a gradient keep their autograd path
    weights = kjt.weights().clone().requires_grad_()
    grad_kjt = KeyedJaggedTensor(kjt.keys(), kjt.values(), weights, lengths=kjt.lengths(), stride=3)
    out = KeyPermutation(PERM).apply(grad_kjt)
    out.weights().sum().backward()
    assert torch.equal(weights.grad, torch.ones_like(weights))
    # a variable batch per key
    variable = KeyedJaggedTensor(
        ["a", "b", "c", "d"],
        torch.arange(6),
        lengths=torch.tensor([1, 1, 2, 0, 1, 1]),
        stride_per_key_per_rank=[[1], [2], [1], [2]],
    )
    _same(KeyPermutation(PERM).apply(variable), variable.permute(PERM))
