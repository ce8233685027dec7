"""parse_projection_file and the per-process caches, for both on-disk formats."""

from __future__ import annotations

import pickle

import pytest
import torch

from shardkit.distill import (
    clear_projection_caches,
    get_sparse_projection_matrix,
    get_topk_projection,
    parse_projection_file,
)
from shardkit.distill import projection_files as pf


@pytest.fixture(autouse=True)
def _fresh_caches():
    clear_projection_caches()
    yield
    clear_projection_caches()


def _dense(tmp_path):
    indices = torch.tensor([[2, -1, -1], [0, 3, -1], [1, 2, 4]])
    likelihoods = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    path = tmp_path / "dense.pt"
    torch.save({"indices": indices, "likelihoods": likelihoods}, path)
    return path, indices, likelihoods


def test_dense_format(tmp_path):
    path, indices, likelihoods = _dense(tmp_path)
    idx, val, v_s, v_t = parse_projection_file(path)
    assert (v_s, v_t) == (3, 5)
    # one COO entry per slot, row-major, sentinels kept
    assert idx[0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert idx[1].tolist() == indices.reshape(-1).tolist()
    assert torch.equal(val, likelihoods.reshape(-1))
    m = get_sparse_projection_matrix(path, torch.device("cpu"), student_vocab_size=4, teacher_vocab_size=2)
    assert m.shape == (4, 5) and m.is_coalesced() and m.dtype == torch.float32
    ref = torch.zeros(4, 5)
    for s in range(3):
        for j in range(3):
            if indices[s, j] >= 0:
                ref[s, indices[s, j]] += likelihoods[s, j]
    torch.testing.assert_close(m.to_dense(), ref)
    i2, l2 = get_topk_projection(path, "cpu")
    assert torch.equal(i2, indices) and torch.equal(l2, likelihoods)


def test_sparse_format(tmp_path):
    path = tmp_path / "sparse.pt"
    torch.save({(0, 1): 3, (2, 0): 1.5, (0, 4): 1}, path)
    idx, val, v_s, v_t = parse_projection_file(path)
    assert (v_s, v_t) == (3, 5)
    assert idx.tolist() == [[0, 2, 0], [1, 0, 4]] and val.tolist() == [3.0, 1.5, 1.0]
    m = get_sparse_projection_matrix(path, "cpu", student_vocab_size=6, teacher_vocab_size=7)
    assert m.shape == (6, 7)
    assert m.to_dense()[0, 1] == 3 and m.to_dense()[2, 0] == 1.5 and m.to_dense().sum() == 5.5
    with pytest.raises(ValueError, match="dense top-k"):
        get_topk_projection(path, "cpu")
    empty = tmp_path / "empty.pt"
    torch.save({}, empty)
    idx, val, v_s, v_t = parse_projection_file(empty)
    assert idx.shape == (2, 0) and (v_s, v_t) == (0, 0)


def test_caches_are_keyed_and_skip_io(tmp_path):
    path, _, _ = _dense(tmp_path)
    a = get_sparse_projection_matrix(path, "cpu", student_vocab_size=3, teacher_vocab_size=5)
    b = get_sparse_projection_matrix(path, torch.device("cpu"), student_vocab_size=3, teacher_vocab_size=5)
    c = get_sparse_projection_matrix(path, "cpu", student_vocab_size=3, teacher_vocab_size=9)
    assert a is b and c is not a and c.shape == (3, 9)
    assert (str(path), torch.device("cpu"), 3, 5) in pf._SPARSE_PROJECTION_CACHE
    t1 = get_topk_projection(path, "cpu")
    path.unlink()  # cached: no disk I/O any more
    assert get_topk_projection(path, "cpu") is t1
    assert get_sparse_projection_matrix(path, "cpu", student_vocab_size=3, teacher_vocab_size=5) is a
    clear_projection_caches()
    with pytest.raises(FileNotFoundError, match="dense.pt"):
        get_topk_projection(path, "cpu")


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        parse_projection_file(tmp_path / "nope.pt")
    cases = {
        "list.pt": [1, 2],
        "shape.pt": {"indices": torch.zeros(2, 3, dtype=torch.long), "likelihoods": torch.zeros(2, 2)},
        "negative.pt": {"indices": torch.tensor([[-2]]), "likelihoods": torch.ones(1, 1)},
        "floatidx.pt": {"indices": torch.zeros(1, 1), "likelihoods": torch.ones(1, 1)},
        "badkey.pt": {(1, 2, 3): 1.0},
        "negkey.pt": {(-1, 2): 1.0},
        "badval.pt": {(1, 2): "x"},
        # numbers that would make the loss NaN, or ids that overflow: each names its file
        "nancount.pt": {(1, 2): float("nan")},
        "infcount.pt": {(1, 2): float("inf")},
        "negcount.pt": {(1, 2): -0.5},
        "hugeid.pt": {(1, 2**70): 1.0},
        "nanlikelihood.pt": {
            "indices": torch.tensor([[0, 1]]),
            "likelihoods": torch.tensor([[0.5, float("nan")]]),
        },
        "neglikelihood.pt": {"indices": torch.tensor([[0, 1]]), "likelihoods": torch.tensor([[-1.0, 2.0]])},
        "inflikelihood.pt": {"indices": torch.tensor([[0]]), "likelihoods": torch.tensor([[float("inf")]])},
        "hugeindex.pt": {"indices": torch.tensor([[2**62]]), "likelihoods": torch.ones(1, 1)},
    }
    for name, obj in cases.items():
        torch.save(obj, tmp_path / name)
        with pytest.raises(ValueError, match=name):
            parse_projection_file(tmp_path / name)
    # an unused slot (-1) may hold anything: its likelihood is ignored
    torch.save(
        {"indices": torch.tensor([[0, -1]]), "likelihoods": torch.tensor([[1.0, float("nan")]])},
        tmp_path / "ok.pt",
    )
    parse_projection_file(tmp_path / "ok.pt")
    with pytest.raises(ValueError, match="non-negative int"):
        get_sparse_projection_matrix(tmp_path / "list.pt", "cpu", student_vocab_size=-1, teacher_vocab_size=1)


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_weights_only_refuses_code(tmp_path):
    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"indices": _Evil()}, f, protocol=2)
    with pytest.raises(ValueError, match="weights_only"):
        parse_projection_file(path)
