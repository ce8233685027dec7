"""The ``.npy`` format with torch alone: round trips, numpy's exact bytes, and clear errors."""

import io

import pytest
import torch

from shardkit.datasets.npy import load_npy, read_npy_header, save_npy

CASES = [
    torch.arange(12, dtype=torch.int32).reshape(3, 4),
    torch.linspace(-1, 1, 5),
    torch.zeros(0, 13),
    torch.tensor(3.5, dtype=torch.float64),
    torch.tensor([True, False]),
    torch.arange(-3, 3, dtype=torch.int64).reshape(1, 2, 3),
    torch.arange(8, dtype=torch.uint8).reshape(2, 2, 2),
    torch.ones(2, 3, dtype=torch.float16),
]


@pytest.mark.parametrize("tensor", CASES, ids=lambda t: f"{t.dtype}{list(t.shape)}")
@pytest.mark.parametrize("mmap_mode", [False, True])
def test_round_trip_keeps_shape_dtype_and_values(tmp_path, tensor, mmap_mode):
    path = tmp_path / "a.npy"
    save_npy(path, tensor)
    loaded = load_npy(path, mmap_mode=mmap_mode)
    assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape
    assert torch.equal(loaded, tensor)
    with open(path, "rb") as stream:
        assert read_npy_header(stream) == (tuple(tensor.shape), tensor.dtype)


def test_a_non_contiguous_tensor_is_saved_in_c_order_and_mmap_writes_stay_private(tmp_path):
    tensor = torch.arange(6, dtype=torch.int32).reshape(2, 3).t()
    save_npy(tmp_path / "t.npy", tensor)
    mapped = load_npy(tmp_path / "t.npy", mmap_mode=True)
    assert torch.equal(mapped, tensor)
    mapped[0, 0] = 99  # copy-on-write: the file keeps its value
    assert load_npy(tmp_path / "t.npy")[0, 0] == 0


@pytest.mark.parametrize("tensor", CASES, ids=lambda t: f"{t.dtype}{list(t.shape)}")
def test_files_are_numpys_bytes_and_numpy_files_load(tmp_path, tensor):
    np = pytest.importorskip("numpy", reason="numpy is needed to compare with numpy.save / numpy.load")
    ours, theirs = io.BytesIO(), io.BytesIO()
    save_npy(ours, tensor)
    np.save(theirs, tensor.numpy())
    assert ours.getvalue() == theirs.getvalue()
    np.save(tmp_path / "n.npy", tensor.numpy())
    assert torch.equal(load_npy(tmp_path / "n.npy"), tensor)
    assert (np.load(io.BytesIO(ours.getvalue())) == tensor.numpy()).all()


def test_unsupported_or_broken_files_name_the_file_and_the_problem(tmp_path):
    path = tmp_path / "bad.npy"
    path.write_bytes(b"hello world")
    with pytest.raises(ValueError, match=r"bad.npy: not a .npy file"):
        load_npy(path)
    save_npy(path, torch.arange(10, dtype=torch.int64))
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ValueError, match=r"bad.npy: the file ends after 72 of 80 data bytes"):
        load_npy(path)
    header = b"{'descr': '>i4', 'fortran_order': False, 'shape': (2,), }".ljust(117) + b"\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + bytes(8))
    with pytest.raises(ValueError, match=r"bad.npy: dtype '>i4' is not supported"):
        load_npy(path)
    header = b"{'descr': '<i4', 'fortran_order': True, 'shape': (2, 2), }".ljust(117) + b"\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + bytes(16))
    with pytest.raises(ValueError, match=r"bad.npy: Fortran-order arrays are not supported"):
        load_npy(path)
    with pytest.raises(ValueError, match=r"cannot save dtype torch.bfloat16"):
        save_npy(tmp_path / "b.npy", torch.zeros(2, dtype=torch.bfloat16))
