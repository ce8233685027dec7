"""The slow tier of an offloaded table shard: a file of named fields, mapped into memory as tensors.

An offloaded shard keeps its rows (and its fused optimizer's state) here instead of in RAM; the lookup
either reads these tensors directly (``fused_uvm``) or through a :class:`~shardkit.kernels.offload.
row_cache.RowCache` of hot rows (``fused_uvm_caching``).

File layout (``*.skoff``): a 4096-byte header, then one region per field, each aligned to 4096 bytes::

    b"SKOFF001" | uint32 JSON length | JSON {"identity": ..., "fields": [[name, dtype, shape, offset]],
    "size": total bytes, "owner": creating process (pid, start time, ...; stale_dirs.py)} | zero padding

The file is mapped ``MAP_SHARED``: writing a field's tensor writes the file, and the kernel's page cache
holds what was touched recently. :meth:`BackingStore.drop_resident` (``madvise(MADV_DONTNEED)``) unmaps
those pages from this process, so its resident set stays bounded by what one step touches; dirty pages
stay in the page cache and reach the file, nothing is lost. Files are created exclusively (never an
existing file silently reused) and removed when the store is closed or the process exits: a backing file
is scratch space, the durable form of a table is its checkpoint. A killed process's default directory is
removed by the next process (``stale_dirs.py``); files a killed run left in a chosen directory are only
named in errors (:func:`stale_backing_files`), never removed automatically.

On CUDA the slow tier is pinned host memory instead (:meth:`BackingStore.in_host_memory`), with the same
interface.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import mmap
import os
import shutil
import struct
import tempfile
import threading
import uuid
import weakref
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from shardkit.kernels.offload import stale_dirs
from shardkit.kernels.offload.malloc_bound import fix_malloc_thresholds
from shardkit.kernels.offload.row_io import FileRowIO, advise_random

MAGIC = b"SKOFF001"
HEADER_BYTES = 4096
_ALIGN = 4096
# where backing files go when the caller names no directory (else a per-process temporary directory)
OFFLOAD_DIR_ENV = "SHARDKIT_OFFLOAD_DIR"
# bytes of backing files this process may keep mapped and resident (see BackingStore.keep_mapped)
RESIDENT_MAP_ENV = "SHARDKIT_OFFLOAD_RESIDENT_MAP"

FieldSpec = Tuple[Tuple[int, ...], torch.dtype]

_temp_dir_lock = threading.Lock()
_temp_dir: Optional[str] = None
# bytes of the stores that keep their mapping resident now (their whole files), against the allowance
_resident_lock = threading.Lock()
_resident_bytes = 0


def resident_map_allowance() -> int:
    """Bytes of backing files this process may keep mapped persistently (``$SHARDKIT_OFFLOAD_RESIDENT_MAP``:
    bytes, or with a ``K`` / ``M`` / ``G`` suffix (powers of 1024); unset, empty, ``0`` or ``off``: none).
    Raises ValueError naming the variable for anything else."""
    raw = os.environ.get(RESIDENT_MAP_ENV, "").strip()
    if raw.lower() in ("", "0", "off"):
        return 0
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(raw[-1].lower(), 1)
    digits = raw[:-1] if scale > 1 else raw
    if not digits.isdigit():
        raise ValueError(f"${RESIDENT_MAP_ENV}={raw!r}: expected bytes (e.g. 536870912, 512M, 2G) or 0 / off")
    return int(digits) * scale


def _release_resident(nbytes: int) -> None:
    global _resident_bytes
    with _resident_lock:
        _resident_bytes -= nbytes


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def default_offload_dir() -> str:
    """``$SHARDKIT_OFFLOAD_DIR`` if set, else a temporary directory of this process, removed at exit.

    The temporary directory carries a marker naming its owner (pid and start time); creating it first
    removes this user's default directories whose owner died without its exit clean-up (killed, out of
    memory, crashed), saying on stderr what was removed and the bytes freed (``stale_dirs.py``). A
    directory named by ``$SHARDKIT_OFFLOAD_DIR`` or ``offload_dir`` is never swept.
    """
    configured = os.environ.get(OFFLOAD_DIR_ENV)
    if configured:
        return configured
    global _temp_dir
    with _temp_dir_lock:
        if _temp_dir is None or not os.path.isdir(_temp_dir):
            pid = os.getpid()
            _temp_dir = tempfile.mkdtemp(prefix=f"{stale_dirs.DIR_PREFIX}{pid}-")
            atexit.register(shutil.rmtree, _temp_dir, True)
            stale_dirs.write_marker(_temp_dir)
            stale_dirs.sweep_dead(os.path.dirname(_temp_dir), keep=_temp_dir)
        return _temp_dir


def layout(fields: Mapping[str, FieldSpec]) -> Tuple[Dict[str, int], int]:
    """Byte offset of each field's region and the file's total size."""
    offsets, end = {}, HEADER_BYTES
    for name, (shape, dtype) in fields.items():
        offsets[name] = end
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        end = _round_up(end + nbytes, _ALIGN)
    return offsets, end


def bytes_needed(fields: Mapping[str, FieldSpec]) -> int:
    """Size in bytes of a backing file holding ``fields`` (header and alignment included)."""
    return layout(fields)[1]


def check_directory(directory: str, needed: int) -> None:
    """OSError naming ``directory`` unless it exists, is writable and has ``needed`` bytes free."""
    if not os.path.isdir(directory):
        raise OSError(f"offload directory {directory!r} does not exist (needed for {needed} bytes of tables)")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OSError(
            f"offload directory {directory!r} is not writable (needed for {needed} bytes of tables)"
        )
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise OSError(
            f"offload directory {directory!r} has {free} bytes free, the offloaded tables need {needed}; "
            f"free space or choose another directory (fused_params['offload_dir'] or ${OFFLOAD_DIR_ENV})"
            + _stale_files_hint(directory)
        )


def stale_backing_files(directory: str) -> List[Tuple[str, int]]:
    """(path, bytes on disk) of the backing files in ``directory`` whose creating process is certainly
    dead (killed before its exit clean-up; the owner recorded in the header, ``stale_dirs.owner_is_dead``).
    Files of live runs, of other hosts, or without an owner record are not listed. Nothing is removed:
    a user-chosen directory is never swept automatically."""
    found = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        path = os.path.join(directory, name)
        if not name.endswith(".skoff") or not os.path.isfile(path) or os.path.islink(path):
            continue
        try:
            owner = read_header(path).get("owner")
            blocks = os.stat(path).st_blocks * 512
        except (OSError, ValueError):
            continue
        if isinstance(owner, dict) and stale_dirs.owner_is_dead(owner):
            found.append((path, blocks))
    return found


def _stale_files_hint(directory: str) -> str:
    """What an error about ``directory`` adds on the backing files that dead runs left in it."""
    stale = stale_backing_files(directory)
    if not stale:
        return ""
    shown = " ".join(repr(p) for p, _ in stale[:3]) + (" ..." if len(stale) > 3 else "")
    total = sum(b for _, b in stale)
    return (
        f"; {len(stale)} backing file(s) in it were left by runs that were killed ({total} bytes: "
        f"{shown}); a chosen offload directory is never cleaned automatically: if no run needs them, "
        f"remove them (rm the files; shardkit.kernels.offload.backing_store.stale_backing_files lists them)"
    )


def _encode_header(identity: Mapping[str, object], fields: Mapping[str, FieldSpec], size: int) -> bytes:
    offsets, _ = layout(fields)
    content = {
        "identity": dict(identity),
        "fields": [[n, _dtype_name(d), list(s), offsets[n]] for n, (s, d) in fields.items()],
        "size": size,
        # who created the file (pid + start time): tells a killed run's leftovers (stale_backing_files)
        "owner": stale_dirs.owner_record(),
    }
    body = json.dumps(content, sort_keys=True).encode()
    if len(body) + 12 > HEADER_BYTES:  # the owner is a hint: a header that fits without it stays valid
        del content["owner"]
        body = json.dumps(content, sort_keys=True).encode()
    header = MAGIC + struct.pack("<I", len(body)) + body
    if len(header) > HEADER_BYTES:
        raise ValueError(f"backing-file header of {len(header)} bytes exceeds {HEADER_BYTES}")
    return header.ljust(HEADER_BYTES, b"\0")


def read_header(path: str) -> dict:
    """The JSON header of backing file ``path``; ValueError naming the path if it is not one or is damaged."""
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
        size = os.fstat(f.fileno()).st_size
    if len(raw) < 12 or raw[:8] != MAGIC:
        raise ValueError(f"{path!r} is not a shardkit backing file (bad magic)")
    (length,) = struct.unpack("<I", raw[8:12])
    try:
        header = json.loads(raw[12 : 12 + length].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"backing file {path!r} has a damaged header: {e}") from None
    if header.get("size") != size:
        raise ValueError(
            f"backing file {path!r} is {size} bytes, its header says {header.get('size')}: damaged"
        )
    return header


class BackingStore:
    """Named fields ``[rows, *width]`` in a slow tier: a mapped file (CPU) or pinned host memory (CUDA).

    Use :meth:`create` (a new file) or :meth:`open` (an existing one, checked against what it must hold)
    or :meth:`in_host_memory`. ``tensors[name]`` is the field as a tensor; writes go to the tier.
    """

    def __init__(
        self,
        tensors: Dict[str, torch.Tensor],
        path: Optional[str],
        mapping: Optional[mmap.mmap],
        fd: Optional[int] = None,
        fields: Optional[Mapping[str, FieldSpec]] = None,
    ):
        self.tensors = tensors
        self.path = path
        self._mapping = mapping
        self._base = 0
        if mapping is not None:
            # the mapping's address, to tell which tensors alias it (store_of) and to alias them (alias)
            probe = ctypes.c_char.from_buffer(mapping)
            self._base = ctypes.addressof(probe)
            del probe  # releases the buffer export again
            _live_stores.add(self)
        # a descriptor kept open for positioned row I/O (:meth:`row_io`), closed with the store
        self._fd = fd
        self._fields = dict(fields) if fields is not None else None
        # True once keep_mapped() claimed the allowance: drop_resident() then leaves the pages mapped
        self.resident = False
        # (start, stop) byte ranges, page-aligned, that drop_resident() leaves mapped (keep_fields_mapped)
        self._kept: List[Tuple[int, int]] = []
        if fd is not None:
            weakref.finalize(self, _close_quietly, fd)
            advise_random(fd)  # misses read scattered rows: no readahead, small page-cache folios
        if path is not None:
            # the mapping stays valid after the unlink: the tensors never dangle, the file goes at exit
            self._finalizer = weakref.finalize(self, _remove_quietly, path)

    @classmethod
    def create(
        cls,
        fields: Mapping[str, FieldSpec],
        identity: Mapping[str, object],
        directory: Optional[str] = None,
        name: str = "table",
    ) -> BackingStore:
        """A new zero-filled file in ``directory`` (default :func:`default_offload_dir`).

        fields: field name -> (shape, dtype); identity: what the file holds (table, shard, run), kept in
        the header and checked by :meth:`open`. Raises OSError naming the directory and the bytes needed
        if it is missing, not writable or too small.
        """
        directory = directory or default_offload_dir()
        size = bytes_needed(fields)
        check_directory(directory, size)
        fix_malloc_thresholds()  # the process's resident set is then what is live (malloc_bound.py)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]
        path = os.path.join(directory, f"{safe}-{os.getpid()}-{uuid.uuid4().hex[:12]}.skoff")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise FileExistsError(
                f"backing file {path!r} already exists (an existing backing file is never reused); if no "
                f"run needs it, remove it" + _stale_files_hint(directory)
            ) from None
        try:
            os.write(fd, _encode_header(identity, fields, size))
            try:
                os.posix_fallocate(
                    fd, 0, size
                )  # reserve the blocks now: a full disk fails here, not mid-step
            except OSError as e:
                raise OSError(f"cannot reserve {size} bytes for {path!r}: {e.strerror}") from None
            mapping = _mapped(fd, size)
        except BaseException:
            os.close(fd)
            _remove_quietly(path)
            raise
        return cls(_map_fields(mapping, fields), path, mapping, fd, fields)

    @classmethod
    def open(cls, path: str, fields: Mapping[str, FieldSpec], identity: Mapping[str, object]) -> BackingStore:
        """Map an existing backing file; ValueError naming the path if it holds anything but ``fields``
        of ``identity`` (another table, shape, dtype or run) or is damaged."""
        header = read_header(path)
        expected = json.loads(_encode_header(identity, fields, header["size"]).rstrip(b"\0")[12:].decode())
        for key in ("identity", "fields", "size"):
            if header.get(key) != expected[key]:
                raise ValueError(
                    f"backing file {path!r} holds {key} {header.get(key)!r}, expected {expected[key]!r}"
                )
        fix_malloc_thresholds()
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = _mapped(fd, header["size"])
        except BaseException:
            os.close(fd)
            raise
        store = cls(_map_fields(mapping, fields), None, mapping, fd, fields)
        store.path = path  # opened, not created: the caller owns the file
        return store

    @classmethod
    def in_host_memory(cls, fields: Mapping[str, FieldSpec]) -> BackingStore:
        """Zeroed pinned host tensors (the slow tier of a CUDA device's cache)."""
        tensors = {
            n: torch.zeros(s, dtype=d, pin_memory=torch.cuda.is_available()) for n, (s, d) in fields.items()
        }
        return cls(tensors, None, None)

    @property
    def num_rows(self) -> int:
        return next(iter(self.tensors.values())).size(0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory lies in this store's mapped file."""
        if self._mapping is None or tensor.device.type != "cpu" or tensor.numel() == 0:
            return False
        start = tensor.data_ptr()
        return self._base <= start and start + tensor.nbytes <= self._base + len(self._mapping)

    def alias(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor on the same file pages as ``tensor`` (a contiguous view of one of the fields) whose
        storage is exactly its own bytes: no copy. ``torch.distributed.checkpoint`` clones a tensor whose
        storage is larger than the tensor before writing it (a row slice of a field is such a view), and
        keeps what it wrote until the file is complete: a checkpoint of a shard would hold a copy of it in
        RAM. An alias is written straight from the mapped file."""
        if tensor.numel() == 0 or not self.contains(tensor):
            return tensor
        if not tensor.is_contiguous():
            raise ValueError(f"backing file {self.path!r}: only a contiguous view can be aliased")
        flat = torch.frombuffer(
            self._mapping, dtype=tensor.dtype, count=tensor.numel(), offset=tensor.data_ptr() - self._base
        )
        return flat.view(tensor.shape)

    def row_io(self, fields: Optional[Sequence[str]] = None) -> Optional[FileRowIO]:
        """Positioned reads / writes of whole rows of this file's fields (None for host memory);
        ``fields``: of these fields only (default: all; ValueError for a name the file does not hold)."""
        if self._fd is None or self._fields is None:
            return None
        names = list(self._fields) if fields is None else list(fields)
        unknown = sorted(set(names) - set(self._fields))
        if unknown:
            raise ValueError(
                f"backing file {self.path!r} has no fields {unknown} (it has {list(self._fields)})"
            )
        offsets, _ = layout(self._fields)
        regions = {n: (offsets[n], tuple(self._fields[n][0]), self._fields[n][1]) for n in names}
        return FileRowIO(self._fd, regions, self.path or "?", self.tensors, self.drop_resident)

    def keep_fields_mapped(self, names: Sequence[str]) -> int:
        """Keep the pages of fields ``names`` mapped (:meth:`drop_resident` leaves their regions alone)
        and return their bytes, which then count in the process's resident set once touched.

        Why: a narrow field such as row-wise Adagrad's one float a row costs a system call per miss read
        and a read-modify-write per write-back through ``preadv`` / ``pwritev`` (measured: ~0.1 us read,
        ~0.45 us written a row, a quarter of a miss's I/O), but only 4 bytes a table row to keep: as
        much as the row cache's slot map. Kept mapped, its rows move by ``index_select`` /
        ``index_copy_`` on the mapped tensor (what a training step reads and writes of it is the file,
        as before: state dicts, checkpoints and loads are unchanged). ValueError for an unknown field."""
        if self._fields is None or self._mapping is None:
            return 0
        unknown = sorted(set(names) - set(self._fields))
        if unknown:
            raise ValueError(
                f"backing file {self.path!r} has no fields {unknown} (it has {list(self._fields)})"
            )
        offsets, _ = layout(self._fields)
        page = mmap.PAGESIZE
        kept = 0
        for name in names:
            shape, dtype = self._fields[name]
            nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            start = offsets[name] // page * page
            self._kept.append((start, _round_up(offsets[name] + nbytes, page)))
            kept += nbytes
        self._kept.sort()
        return kept

    @property
    def kept_bytes(self) -> int:
        """Bytes of the regions :meth:`keep_fields_mapped` keeps mapped (page-rounded)."""
        return sum(stop - start for start, stop in self._kept)

    def keep_mapped(self) -> bool:
        """Keep this file's pages mapped from now on, if the process's allowance
        (:func:`resident_map_allowance`) still has room for the whole file; returns whether it did.

        Why: a row moved through a page that stays mapped is a ``memcpy`` (about 0.1 us for a 256-byte
        row read, 0.05 us written, measured on the shared 2-core VM), where a ``preadv`` / ``pwritev``
        per row costs 1-2 us of system call and page-cache work, and a page unmapped after use costs a
        fault (which maps the kernel's fault-around window, ~64 KiB) plus the ``madvise`` again. The
        price: every page touched stays in this process's resident set (``RssFile``, counted by
        ``VmHWM``), up to the whole file, until the store is closed; so only files that fit the
        allowance as a whole keep their mapping, and :meth:`drop_resident` is then a no-op. The pages
        are the kernel's page cache either way (reclaimable, dirty ones written to the file by the
        kernel's writeback); nothing changes in what is read or written.
        """
        global _resident_bytes
        if self.resident:
            return True
        if self._mapping is None:
            return False
        size = len(self._mapping)
        allowance = resident_map_allowance()
        with _resident_lock:
            if _resident_bytes + size > allowance:
                return False
            _resident_bytes += size
        self.resident = True
        weakref.finalize(self, _release_resident, size)
        return True

    def drop_resident(self) -> None:
        """Unmap the pages this process touched (they stay in the page cache, dirty ones reach the file);
        nothing while the store keeps its mapping (:meth:`keep_mapped`), and not the regions of the
        fields :meth:`keep_fields_mapped` keeps."""
        if self._mapping is None or self.resident:
            return
        if not self._kept:
            self._mapping.madvise(mmap.MADV_DONTNEED)
            return
        at = 0  # the pages between the kept regions (page-aligned: keep_fields_mapped rounds them)
        for start, stop in self._kept + [(len(self._mapping), len(self._mapping))]:
            if start > at:
                self._mapping.madvise(mmap.MADV_DONTNEED, at, start - at)
            at = max(at, stop)

    def flush(self) -> None:
        """Write dirty pages to the file now (``msync``)."""
        if self._mapping is not None:
            self._mapping.flush()

    def close(self) -> None:
        """Remove the file this store created (its tensors stay readable and writable until they are
        dropped)."""
        if self.path is not None and getattr(self, "_finalizer", None) is not None:
            self._finalizer()


def _mapped(fd: int, size: int) -> mmap.mmap:
    """``fd`` mapped shared, read-write, with random-access advice.

    Why the advice: the page cache of a file touched sequentially (the chunked initialization) is built
    of large folios, and a page fault maps a whole folio (up to 2 MiB on ext4 with Linux 6.x): each
    random row lookup then made megabytes resident, and a few hundred lookups the whole table, beyond any
    memory budget. ``MADV_RANDOM`` before the first access turns readahead off, so the page cache of this
    mapping is built of single pages: a row written maps its own page, a row read its page and the
    kernel's fault-around window (64 KiB by default) of pages already cached.
    """
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    advice = getattr(mmap, "MADV_RANDOM", None)  # Linux / macOS; elsewhere no advice
    if advice is not None:
        mapping.madvise(advice)
    return mapping


_live_stores: weakref.WeakSet[BackingStore] = weakref.WeakSet()


def store_of(tensor: torch.Tensor) -> Optional[BackingStore]:
    """The live file-backed store whose mapping holds ``tensor``'s memory, or None (an ordinary tensor)."""
    for store in list(_live_stores):
        if store.contains(tensor):
            return store
    return None


def file_backed_copies(
    tensors: Sequence[torch.Tensor], directory: Optional[str], chunk_bytes: int = 64 << 20
) -> List[torch.Tensor]:
    """Copies of ``tensors`` (one dtype) in one new scratch backing file in ``directory``, each copied
    ``chunk_bytes`` at a time with the files' pages unmapped between chunks: the copies never hold the
    tensors in RAM, and one file (one mapping) serves them all however many pieces a table is cut into.
    The file is unlinked at once (the mapping lives as long as the returned tensors). Raises OSError
    naming the directory and the bytes needed if it cannot hold the copies."""
    if not tensors:
        return []
    dtype = tensors[0].dtype
    total = sum(t.numel() for t in tensors)
    scratch = BackingStore.create({"data": ((total,), dtype)}, {"scratch": "copy"}, directory, "scratch")
    scratch.close()  # unlinked now: nothing is left behind, whatever happens to this process
    flat, out, at = scratch.tensors["data"], [], 0
    flat.backing_store = scratch  # alive while the copies are: store_of finds it (drop_resident)
    for tensor in tensors:
        if tensor.dtype != dtype:
            raise ValueError(f"file_backed_copies: tensors of dtypes {dtype} and {tensor.dtype}")
        target = flat[at : at + tensor.numel()].view(tensor.shape)
        target.backing_store = scratch
        at += tensor.numel()
        out.append(target)
        if tensor.dim() == 0 or tensor.numel() == 0:
            target.copy_(tensor)
            continue
        source = store_of(tensor)
        step = max(1, chunk_bytes // max(1, tensor[0].numel() * tensor.element_size()))
        with torch.no_grad():
            for row in range(0, tensor.size(0), step):
                target[row : row + step].copy_(tensor[row : row + step])
                scratch.drop_resident()
                if source is not None:
                    source.drop_resident()
    return out


def _map_fields(mapping: mmap.mmap, fields: Mapping[str, FieldSpec]) -> Dict[str, torch.Tensor]:
    offsets, _ = layout(fields)
    tensors = {}
    for name, (shape, dtype) in fields.items():
        count = int(torch.Size(shape).numel())
        if count == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mapping, dtype=dtype, count=count, offset=offsets[name])
        tensors[name] = flat.view(shape)
    return tensors


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def field_specs(weight_shape: Sequence[int], weight_dtype: torch.dtype, state: Mapping[str, Sequence[int]]):
    """The fields of an offloaded shard: ``weight`` then each fp32 optimizer state tensor."""
    fields: Dict[str, FieldSpec] = {"weight": (tuple(weight_shape), weight_dtype)}
    for name, shape in state.items():
        fields[f"state.{name}"] = (tuple(shape), torch.float32)
    return fields
