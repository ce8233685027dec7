"""torchrec's data-pipe utilities (``torchrec.datasets.utils``): open files, read CSV / TSV lines, cap a
stream, and read several pipes one after another, split between ``DataLoader`` workers."""

from __future__ import annotations

import csv
import os
from typing import IO, Any, Callable, Iterable, Iterator, List, Sequence, Tuple

from torch.utils.data import get_worker_info

from shardkit.datasets.datapipe import IterDataPipe, functional_datapipe

PATH_MANAGER_KEY = "torchrec"  # torchrec's iopath key; shardkit opens local files with open()
_MODES = {"b": "rb", "t": "rt", "rb": "rb", "rt": "rt", "r": "r"}


@functional_datapipe("limit")
class Limit(IterDataPipe):
    """The first ``limit`` items of ``datapipe`` (all of them if it has fewer); also ``pipe.limit(n)``."""

    def __init__(self, datapipe: Iterable[Any], limit: int) -> None:
        super().__init__()
        self.datapipe, self.limit = datapipe, limit

    def __iter__(self) -> Iterator[Any]:
        if self.limit <= 0:
            return
        for index, item in enumerate(self.datapipe):
            yield item
            if index + 1 >= self.limit:
                return  # without asking the source for one more item


class LoadFiles(IterDataPipe):
    """``(path, open file)`` for each path of ``datapipe``, opened with ``open(path, mode, **open_kw)``.

    ``mode`` is ``"b"`` / ``"rb"`` (bytes), ``"t"`` / ``"rt"`` / ``"r"`` (text). ``length`` is what
    ``len()`` answers (-1: unknown, ``len()`` raises TypeError; torchrec's raises NotImplementedError,
    which also breaks ``list(LoadFiles(...))``). The consumer
    owns the files (``ReadLinesFromCSV`` closes each once read). ``path_manager_key`` exists for
    torchrec's signature: shardkit reads local paths only, without iopath.
    """

    def __init__(
        self,
        datapipe: Iterable[str],
        mode: str = "b",
        length: int = -1,
        path_manager_key: str = PATH_MANAGER_KEY,
        **open_kw: Any,
    ) -> None:
        super().__init__()
        if mode not in _MODES:
            raise ValueError(f"LoadFiles: invalid mode {mode!r}; use one of {sorted(_MODES)}")
        check_path_manager_key(path_manager_key)
        self.datapipe, self.mode, self.length, self.open_kw = datapipe, mode, length, open_kw

    def __iter__(self) -> Iterator[Tuple[str, IO]]:
        for path in self.datapipe:
            if not isinstance(path, (str, os.PathLike)):
                raise TypeError(f"LoadFiles: expected a path (str), got {type(path).__name__}: {path!r}")
            yield path, open(path, _MODES[self.mode], **self.open_kw)

    def __len__(self) -> int:
        if self.length == -1:
            raise TypeError("LoadFiles: length unknown (pass length= to the constructor)")
        return self.length


def check_path_manager_key(key: str) -> None:
    """Reject an iopath ``path_manager_key`` other than torchrec's default: only local files are read."""
    if key != PATH_MANAGER_KEY:
        raise ValueError(
            f"path_manager_key={key!r}: shardkit opens local paths with open() and has no iopath path "
            f"managers; leave the default ({PATH_MANAGER_KEY!r}) and copy remote files locally first"
        )


class ReadLinesFromCSV(IterDataPipe):
    """The rows (lists of strings) of each ``(path, open file)`` of ``datapipe``, read by ``csv.reader``
    with ``**kw`` (``delimiter="\\t"`` for TSV), skipping each file's first row if ``skip_first_line``.
    Each file is closed once its rows are read."""

    def __init__(self, datapipe: Iterable[Tuple[str, IO]], skip_first_line: bool = False, **kw: Any) -> None:
        super().__init__()
        self.datapipe, self.skip_first_line, self.kw = datapipe, skip_first_line, kw

    def __iter__(self) -> Iterator[List[str]]:
        for _, stream in self.datapipe:
            with stream:
                reader = csv.reader(stream, **self.kw)
                if self.skip_first_line:
                    next(reader, None)
                yield from reader


def _default_dp_selector(datapipes: Sequence[Any]) -> Sequence[Any]:
    """All ``datapipes`` in the main process; in ``DataLoader`` worker ``i`` of ``w``, the ``i``-th of
    ``w`` contiguous groups, the first ``len % w`` groups one pipe larger (torchrec's split)."""
    worker = get_worker_info()
    if worker is None:
        return datapipes
    count, workers = len(datapipes), worker.num_workers
    if workers > count:
        raise ValueError(f"ParallelReadConcat: {workers} DataLoader workers for only {count} datapipes")
    base, extra = divmod(count, workers)
    start = worker.id * base + min(worker.id, extra)
    return datapipes[start : start + base + (worker.id < extra)]


class ParallelReadConcat(IterDataPipe):
    """The items of ``datapipes`` one pipe after another; in a ``DataLoader`` with workers, each worker
    reads the pipes ``dp_selector`` picks for it (by default a contiguous share), so they read in
    parallel. Use ``DataLoader(ParallelReadConcat(*pipes), num_workers=n, batch_size=None)``."""

    def __init__(
        self,
        *datapipes: Iterable[Any],
        dp_selector: Callable[[Sequence[Any]], Sequence[Any]] = _default_dp_selector,
    ) -> None:
        super().__init__()
        self.datapipes, self.dp_selector = datapipes, dp_selector

    def __iter__(self) -> Iterator[Any]:
        for datapipe in self.dp_selector(self.datapipes):
            yield from datapipe


__all__ = ["PATH_MANAGER_KEY", "Limit", "LoadFiles", "ParallelReadConcat", "ReadLinesFromCSV"]
