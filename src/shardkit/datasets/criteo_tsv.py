"""The Criteo click logs' layout (torchrec's constants) and a streaming reader of their TSV files.

A line of the Kaggle (``train.txt``; ``test.txt`` has no label) or Terabyte (``day_N``) files is a 0/1
label, 13 integer features and 26 categorical features (32-bit hashes in hex), tab separated, any of
them possibly empty.
"""

from __future__ import annotations

import csv
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

from torch.utils.data import get_worker_info

from shardkit.datasets.datapipe import IterDataPipe
from shardkit.datasets.pipes import LoadFiles
from shardkit.datasets.utils import safe_cast

FREQUENCY_THRESHOLD = 3
INT_FEATURE_COUNT = 13
CAT_FEATURE_COUNT = 26
DAYS = 24
DEFAULT_LABEL_NAME = "label"
DEFAULT_INT_NAMES: List[str] = [f"int_{i}" for i in range(INT_FEATURE_COUNT)]
DEFAULT_CAT_NAMES: List[str] = [f"cat_{i}" for i in range(CAT_FEATURE_COUNT)]
DEFAULT_COLUMN_NAMES: List[str] = [DEFAULT_LABEL_NAME, *DEFAULT_INT_NAMES, *DEFAULT_CAT_NAMES]
TOTAL_TRAINING_SAMPLES = 4195197692  # rows of Terabyte days 0-22 (day 23 is for validation and test)

Row = Dict[str, Union[int, str]]


def _to_int(value: Any) -> Any:
    return safe_cast(value, int, 0)


def _to_str(value: Any) -> Any:
    return safe_cast(value, str, "")


# one caster per column of DEFAULT_COLUMN_NAMES: the label and integer features to int (0 when empty or
# not a number), the categorical features kept as strings
COLUMN_TYPE_CASTERS: List[Callable[[Any], Any]] = [
    _to_int,
    *[_to_int] * INT_FEATURE_COUNT,
    *[_to_str] * CAT_FEATURE_COUNT,
]


def default_row_mapper(fields: List[str]) -> Row:
    """``{column name: value}`` of one split line through ``COLUMN_TYPE_CASTERS``. Fields pair with the
    columns from the end, so a line without its label (Kaggle's ``test.txt``) fills the last 39
    columns. A line of more than 40 fields raises ValueError (torchrec fails with a RuntimeError)."""
    if len(fields) > len(DEFAULT_COLUMN_NAMES):
        raise ValueError(f"{len(fields)} fields, a Criteo line has at most {len(DEFAULT_COLUMN_NAMES)}")
    start = len(DEFAULT_COLUMN_NAMES) - len(fields)
    return {
        name: cast(field)
        for name, cast, field in zip(DEFAULT_COLUMN_NAMES[start:], COLUMN_TYPE_CASTERS[start:], fields)
    }


_default_row_mapper = default_row_mapper  # torchrec's name


class CriteoIterDataPipe(IterDataPipe):
    """The lines of the Criteo TSV files ``paths``, in order, each split at tabs and passed through
    ``row_mapper`` (None: the list of fields). ``open_kw`` go to ``open()``. Reads lazily; in a
    ``DataLoader`` with ``n`` workers, worker ``i`` reads the files ``i, i + n, ...``.

    A ValueError or IndexError of ``row_mapper`` is raised again with the file and line number."""

    def __init__(
        self,
        paths: Iterable[str],
        *,
        row_mapper: Optional[Callable[[List[str]], Any]] = default_row_mapper,
        **open_kw: Any,
    ) -> None:
        super().__init__()
        self.paths, self.row_mapper, self.open_kw = paths, row_mapper, open_kw

    def __iter__(self) -> Iterator[Any]:
        paths = list(self.paths)
        worker = get_worker_info()
        if worker is not None:
            paths = paths[worker.id :: worker.num_workers]
        for path, stream in LoadFiles(paths, mode="r", **self.open_kw):
            with stream:
                lines = csv.reader(stream, delimiter="\t")
                for fields in lines:
                    yield fields if self.row_mapper is None else self._map(fields, path, lines.line_num)

    def _map(self, fields: List[str], path: str, line: int) -> Any:
        try:
            return self.row_mapper(fields)
        except ValueError as error:
            raise ValueError(f"{path}, line {line}: {error}") from error
        except IndexError as error:
            raise IndexError(f"{path}, line {line}: {error}") from error


def criteo_terabyte(
    paths: Iterable[str],
    *,
    row_mapper: Optional[Callable[[List[str]], Any]] = default_row_mapper,
    **open_kw: Any,
) -> IterDataPipe:
    """The Criteo 1TB click logs (``day_0`` ... ``day_23`` TSV files) as a ``CriteoIterDataPipe``."""
    return CriteoIterDataPipe(paths, row_mapper=row_mapper, **open_kw)


def criteo_kaggle(
    path: str, *, row_mapper: Optional[Callable[[List[str]], Any]] = default_row_mapper, **open_kw: Any
) -> IterDataPipe:
    """The Kaggle Criteo display-advertising ``train.txt`` or ``test.txt`` as a ``CriteoIterDataPipe``."""
    return CriteoIterDataPipe((path,), row_mapper=row_mapper, **open_kw)
