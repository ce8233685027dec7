"""Teacher logits shared between processes without a copy: CUDA IPC on GPUs, shared memory on CPU.

The producer (the teacher's process) owns one persistent ``[B_r, T_t, V_t]`` buffer for the whole
run and copies fresh logits into it each step, so a consumer's view stays valid across steps. It
publishes the buffer as a list of per-sample entries (the handle contract of the documented system)::

    {"rank_logits_ipc": <handle of the whole buffer>, "sample_idx_within_rank": i}

Every entry of a rank carries the same handle. The consumer (the student's loss) opens that one
handle and slices ``[mb_start:mb_end]`` for its microbatch: a view, no allocation, dtype preserved.

Handles are plain picklable data. On CPU the buffer is a file in shared memory (``/dev/shm`` when
present) mapped with ``MAP_SHARED`` by ``torch.from_file``; on CUDA it is PyTorch's CUDA IPC handle
(``torch.multiprocessing.reductions``), which a *different* process must open (CUDA does not let a
process open its own IPC handle).

A handle is untrusted input: mapping a file with ``torch.from_file(shared=True)`` would grow and
write any file it names. A CPU handle is opened only if it names a regular file (not a link) that
shardkit's producer created: in the shared-memory directory, with the producer's name prefix, owned
by this user, and exactly as large as the handle's dtype and size say. Anything else is a
``ValueError`` before the file is touched.
"""

from __future__ import annotations

import math
import os
import stat
import tempfile
import weakref
from typing import Any, Dict, List, Mapping, Sequence

import torch
from torch.multiprocessing import reductions

from shardkit.distributed.shm_files import remove_file

IPC_KEY = "teacher_full_logits_ipc"
_CPU_KIND = "cpu_shared_file"
_CUDA_KIND = "cuda_ipc"
_PREFIX = "shardkit-teacher-logits-"


def _shared_dir() -> str:
    """Where the producer creates its files: ``/dev/shm`` when present, else the temp directory."""
    return os.path.realpath("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"teacher logits IPC handle names an unknown dtype {name!r}")
    return dtype


class TeacherLogitsBuffer:
    """Producer side: a persistent ``[B_r, T_t, V_t]`` buffer that other processes can view.

    Args:
        shape: ``(B_r, T_t, V_t)``: this rank's samples, teacher sequence length, teacher vocabulary.
        dtype: the logits' dtype (kept as is; the loss casts where it needs fp32).
        device: ``cpu`` (shared-memory file) or a CUDA device (CUDA IPC).

    ``tensor`` is the buffer; ``update(logits)`` copies a step's logits into it; ``entries()`` is the
    per-sample handle list to ship to the consumer under ``teacher_full_logits_ipc``. ``close()``
    (also at garbage collection) removes the shared-memory file; consumers' existing views stay valid
    on CPU (the mapping outlives the name), but new consumers can no longer open it.
    """

    def __init__(self, shape: Sequence[int], dtype: torch.dtype = torch.float32, device: Any = "cpu") -> None:
        shape = tuple(int(s) for s in shape)
        if len(shape) != 3 or any(s < 0 for s in shape):
            raise ValueError(
                f"TeacherLogitsBuffer: shape must be (B_r, T_t, V_t) of non-negative ints, got {shape}"
            )
        device = torch.device(device)
        self.shape = shape
        numel = math.prod(shape)
        if device.type == "cuda":
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
            # reduce_tensor gives (rebuild function, arguments); the arguments are the handle
            _, args = reductions.reduce_tensor(self.tensor)
            self._handle: Dict[str, Any] = {"kind": _CUDA_KIND, "args": args}
            self._finalizer = None
        elif device.type == "cpu":
            fd, path = tempfile.mkstemp(prefix=_PREFIX, dir=_shared_dir())
            self._finalizer = weakref.finalize(self, remove_file, path)
            nbytes = max(numel, 1) * torch.empty((), dtype=dtype).element_size()
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
            flat = torch.from_file(path, shared=True, size=max(numel, 1), dtype=dtype)
            self.tensor = flat[:numel].view(shape)
            self._handle = {
                "kind": _CPU_KIND,
                "path": path,
                "dtype": str(dtype).replace("torch.", ""),
                "shape": list(shape),
                "numel": max(numel, 1),
            }
        else:
            raise ValueError(
                f"TeacherLogitsBuffer: device type {device.type!r} is not supported (cpu or cuda)"
            )

    def handle(self) -> Dict[str, Any]:
        """The rank-level handle of the whole buffer (plain picklable data)."""
        return dict(self._handle)

    def entries(self) -> List[Dict[str, Any]]:
        """``[{"rank_logits_ipc": handle, "sample_idx_within_rank": i} for i in range(B_r)]``."""
        handle = self.handle()
        return [{"rank_logits_ipc": handle, "sample_idx_within_rank": i} for i in range(self.shape[0])]

    def update(self, logits: torch.Tensor) -> None:
        """Copy ``logits [B_r, T_t, V_t]`` (any castable dtype) into the buffer; ``logits`` is unchanged.

        On CUDA it waits for the copy to finish: another process reads the buffer on its own stream,
        and nothing else orders that read after this copy.
        """
        if tuple(logits.shape) != self.shape:
            raise ValueError(
                f"TeacherLogitsBuffer.update: logits shape {tuple(logits.shape)} != buffer {self.shape}"
            )
        with torch.no_grad():
            self.tensor.copy_(logits)
        if self.tensor.is_cuda:
            torch.cuda.current_stream(self.tensor.device).synchronize()

    def close(self) -> None:
        """Remove the shared-memory name (CPU); the CUDA allocation lives as long as ``tensor``."""
        if self._finalizer is not None:
            self._finalizer()


def _open(handle: Mapping[str, Any]) -> torch.Tensor:
    kind = handle.get("kind")
    if kind == _CPU_KIND:
        dtype = _dtype_from_name(str(handle.get("dtype")))
        path, shape, numel = _checked_cpu_handle(handle, dtype)
        flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        return flat[: math.prod(shape)].view(shape)
    if kind == _CUDA_KIND:
        return reductions.rebuild_cuda_tensor(*handle["args"]).detach()
    raise ValueError(
        f"teacher logits IPC handle has unknown kind {kind!r} (expected {_CPU_KIND!r} or {_CUDA_KIND!r})"
    )


def _checked_cpu_handle(handle: Mapping[str, Any], dtype: torch.dtype):
    """``(path, shape, numel)`` of a CPU handle, after checking that it names a file shardkit's
    producer made and that mapping it writes nothing (the module doc); ``ValueError`` otherwise."""
    path, shape, numel = handle.get("path"), handle.get("shape"), handle.get("numel")
    if not (isinstance(path, str) and isinstance(shape, (list, tuple)) and isinstance(numel, int)):
        raise ValueError(
            "teacher logits IPC handle: 'path' (str), 'shape' (list), 'numel' (int) are required"
        )
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape) or len(shape) != 3:
        raise ValueError(
            f"teacher logits IPC handle: shape must be 3 non-negative ints, got {str(shape)[:100]}"
        )
    if numel < max(math.prod(shape), 1):
        raise ValueError(f"teacher logits IPC handle: numel {numel} is smaller than the shape {shape}")
    name = os.path.basename(path)
    if os.path.dirname(os.path.realpath(path)) != _shared_dir() or not name.startswith(_PREFIX):
        raise ValueError(
            f"teacher logits IPC handle names {path[:200]!r}, which is not a file shardkit created "
            f"(those are {_shared_dir()}/{_PREFIX}*); refusing to open it"
        )
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"teacher logits shared-memory file {path} is gone (the producer closed it)"
        ) from None
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        raise ValueError(
            f"teacher logits IPC handle: {path} is not a regular file of this user; refusing to open it"
        )
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if info.st_size != expected:
        raise ValueError(
            f"teacher logits IPC handle: {path} has {info.st_size} bytes, the handle says {expected}; "
            "refusing to map it (mapping would resize the file)"
        )
    return path, [int(n) for n in shape], numel


def rebuild_teacher_full_logits_from_ipc(data: Mapping[str, Any]) -> torch.Tensor:
    """View of the microbatch's teacher logits in the producer's buffer (no copy).

    ``data["teacher_full_logits_ipc"]`` is the microbatch's list of per-sample entries (see the
    module doc). All entries must carry the same handle and consecutive ``sample_idx_within_rank``
    values ``mb_start, ..., mb_end - 1``. Returns ``buffer[mb_start:mb_end]``, ``[mb_B, T_t, V_t]`` in
    the producer's dtype, on the producer's device kind: writes by the producer (its next
    ``update``) are visible through it. Raises ``KeyError`` / ``ValueError`` naming what is wrong.
    """
    if IPC_KEY not in data:
        raise KeyError(f"rebuild_teacher_full_logits_from_ipc: the data dict lacks {IPC_KEY!r}")
    entries = data[IPC_KEY]
    if not isinstance(entries, (list, tuple)) or not entries:
        raise ValueError(
            f"rebuild_teacher_full_logits_from_ipc: {IPC_KEY} must be a non-empty list of entries"
        )
    try:
        handle = entries[0]["rank_logits_ipc"]
        idx = [int(e["sample_idx_within_rank"]) for e in entries]
    except (KeyError, TypeError) as err:
        raise ValueError(
            f"rebuild_teacher_full_logits_from_ipc: each entry needs 'rank_logits_ipc' and "
            f"'sample_idx_within_rank' ({err!r})"
        ) from err
    for i, entry in enumerate(entries):
        if entry["rank_logits_ipc"] != handle:
            raise ValueError(
                f"rebuild_teacher_full_logits_from_ipc: entry {i} carries a different handle than entry 0"
            )
    mb_start, mb_end = idx[0], idx[0] + len(idx)
    if idx != list(range(mb_start, mb_end)):
        raise ValueError(
            f"rebuild_teacher_full_logits_from_ipc: sample_idx_within_rank must be consecutive, got {idx}"
        )
    full = _open(handle)
    if mb_start < 0 or mb_end > full.size(0):
        raise ValueError(
            f"rebuild_teacher_full_logits_from_ipc: samples [{mb_start}, {mb_end}) are outside the "
            f"producer's buffer of {full.size(0)} samples"
        )
    return full[mb_start:mb_end]
