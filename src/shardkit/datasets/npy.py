"""numpy's ``.npy`` file format, read and written with torch alone (numpy is not a shardkit dependency).

A ``.npy`` file is the magic ``\\x93NUMPY``, a format version, a little-endian header length, a header
(a Python dict literal: ``descr``, ``fortran_order``, ``shape``) padded with spaces to a multiple of 64
bytes and ended by a newline, then the raw array bytes in C order. Files written here are byte for byte
what ``numpy.save`` writes for the same array, and ``numpy.load`` reads them; files written by numpy in
C order with a little-endian (or one-byte) dtype load here.
"""

from __future__ import annotations

import ast
import mmap
import os
import struct
import sys
from typing import BinaryIO, Dict, Tuple, Union

import torch

MAGIC = b"\x93NUMPY"
_ALIGN = 64
_GROWTH_DIGITS = 21
_CHUNK = 1 << 26  # bytes copied at a time when saving

# numpy type strings (without the byte-order character) <-> torch dtypes
_TORCH_DTYPES: Dict[str, torch.dtype] = {
    "b1": torch.bool,
    "u1": torch.uint8,
    "i1": torch.int8,
    "i2": torch.int16,
    "i4": torch.int32,
    "i8": torch.int64,
    "f2": torch.float16,
    "f4": torch.float32,
    "f8": torch.float64,
    "c8": torch.complex64,
    "c16": torch.complex128,
}
_DESCRS = {dtype: code for code, dtype in _TORCH_DTYPES.items()}

PathOrFile = Union[str, os.PathLike, BinaryIO]


def _descr(dtype: torch.dtype) -> str:
    code = _DESCRS.get(dtype)
    if code is None:
        raise ValueError(f".npy: cannot save dtype {dtype}; supported: {sorted(map(str, _DESCRS))}")
    return ("|" if dtype.itemsize == 1 else "<") + code


def _dtype(descr: object, where: str) -> torch.dtype:
    if isinstance(descr, str) and len(descr) > 1 and descr[0] in "<|=":
        dtype = _TORCH_DTYPES.get(descr[1:])
        if dtype is not None and (descr[0] != "=" or sys.byteorder == "little"):
            return dtype
    raise ValueError(
        f"{where}: dtype {descr!r} is not supported (little-endian bool, int8-64, uint8, float16-64 or "
        "complex only); convert the array with numpy before saving it"
    )


def read_npy_header(stream: BinaryIO, where: str = "<stream>") -> Tuple[Tuple[int, ...], torch.dtype]:
    """Read the magic and header of a ``.npy`` stream, leaving it at the first data byte.

    Returns ``(shape, torch dtype)``. Raises ValueError naming ``where`` for anything that is not a
    C-order ``.npy`` file of a supported dtype."""
    prefix = stream.read(len(MAGIC) + 2)
    if len(prefix) < len(MAGIC) + 2 or prefix[: len(MAGIC)] != MAGIC:
        raise ValueError(f"{where}: not a .npy file (it does not start with the \\x93NUMPY magic)")
    major = prefix[len(MAGIC)]
    if major not in (1, 2, 3):
        raise ValueError(f"{where}: .npy format version {major} is not supported (1, 2 or 3)")
    size_format = "<H" if major == 1 else "<I"
    (header_len,) = struct.unpack(size_format, stream.read(struct.calcsize(size_format)))
    raw = stream.read(header_len)
    try:
        header = ast.literal_eval(raw.decode("latin1" if major < 3 else "utf8"))
        shape = tuple(int(n) for n in header["shape"])
        fortran_order = header["fortran_order"]
        descr = header["descr"]
    except (ValueError, SyntaxError, KeyError, TypeError) as error:
        raise ValueError(f"{where}: unreadable .npy header {raw!r} ({error})") from None
    if fortran_order and len(shape) > 1:
        raise ValueError(f"{where}: Fortran-order arrays are not supported; save the array in C order")
    return shape, _dtype(descr, where)


def _header(shape: Tuple[int, ...], dtype: torch.dtype) -> bytes:
    shape_text = f"({shape[0]},)" if len(shape) == 1 else f"({', '.join(map(str, shape))})"
    text = f"{{'descr': '{_descr(dtype)}', 'fortran_order': False, 'shape': {shape_text}, }}"
    # version 1.0 (a 2-byte header length) always suffices: a tensor has at most 64 dimensions
    if shape:  # numpy leaves room for the first dimension to grow to 21 digits in place
        text += " " * (_GROWTH_DIGITS - len(str(shape[0])))
    fixed = len(MAGIC) + 4
    padded = -(-(fixed + len(text) + 1) // _ALIGN) * _ALIGN - fixed  # the text, spaces, a newline
    body = (text + " " * (padded - len(text) - 1) + "\n").encode("latin1")
    return MAGIC + bytes([1, 0]) + struct.pack("<H", padded) + body


def save_npy(file: PathOrFile, tensor: torch.Tensor) -> None:
    """Write ``tensor`` (any shape, a dtype numpy has) as a ``.npy`` file, as ``numpy.save`` does."""
    data = tensor.detach().cpu().contiguous()
    header = _header(tuple(data.shape), data.dtype)
    payload = data.reshape(-1).view(torch.uint8) if data.numel() else torch.empty(0, dtype=torch.uint8)
    if isinstance(file, (str, os.PathLike)):
        with open(file, "wb") as stream:
            _write(stream, header, payload)
    else:
        _write(file, header, payload)


def _write(stream: BinaryIO, header: bytes, payload: torch.Tensor) -> None:
    stream.write(header)
    # through a bounded bytearray: torch has no public tensor -> bytes view without numpy
    for start in range(0, payload.numel(), _CHUNK):
        part = payload[start : start + _CHUNK]
        buffer = bytearray(part.numel())
        torch.frombuffer(buffer, dtype=torch.uint8).copy_(part)
        stream.write(buffer)


def read_tensor(stream: BinaryIO, dtype: torch.dtype, count: int, where: str) -> torch.Tensor:
    """The next ``count`` elements of ``stream`` as a 1-D tensor of ``dtype`` (ValueError if it ends)."""
    buffer = bytearray(count * dtype.itemsize)
    got = stream.readinto(buffer)
    if got != len(buffer):
        raise ValueError(f"{where}: the file ends after {got} of {len(buffer)} data bytes (truncated?)")
    if not buffer:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype)


def load_npy(path: Union[str, os.PathLike], mmap_mode: bool = False) -> torch.Tensor:
    """The array of a ``.npy`` file as a tensor of its shape and dtype.

    ``mmap_mode=True`` maps the file copy-on-write instead of reading it: rows are read from disk when
    touched, and writes to the tensor stay in this process (numpy's ``mmap_mode="c"``)."""
    where = os.fspath(path)
    with open(path, "rb") as stream:
        shape, dtype = read_npy_header(stream, where)
        count = 1
        for n in shape:
            count *= n
        if not mmap_mode or count == 0:
            return read_tensor(stream, dtype, count, where).reshape(shape)
        offset = stream.tell()
        mapped = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_COPY)
    if len(mapped) < offset + count * dtype.itemsize:
        raise ValueError(f"{where}: the file is shorter than its header's shape {shape} (truncated?)")
    # the tensor keeps ``mapped`` alive; the file descriptor is no longer needed
    return torch.frombuffer(mapped, dtype=dtype, count=count, offset=offset).reshape(shape)


__all__ = ["MAGIC", "load_npy", "read_npy_header", "read_tensor", "save_npy"]
