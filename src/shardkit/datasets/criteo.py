"""The Criteo click logs' layout (torchrec's ``torchrec.datasets.criteo`` constants) and a TSV row reader.

A line of the Kaggle / Terabyte TSV files is a 0/1 label, 13 integer features and 26 categorical
features (32-bit hashes in hex), tab separated, any of them possibly empty.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Union

INT_FEATURE_COUNT = 13
CAT_FEATURE_COUNT = 26
DAYS = 24
DEFAULT_LABEL_NAME = "label"
DEFAULT_INT_NAMES: List[str] = [f"int_{i}" for i in range(INT_FEATURE_COUNT)]
DEFAULT_CAT_NAMES: List[str] = [f"cat_{i}" for i in range(CAT_FEATURE_COUNT)]
DEFAULT_COLUMN_NAMES: List[str] = [DEFAULT_LABEL_NAME, *DEFAULT_INT_NAMES, *DEFAULT_CAT_NAMES]

Row = Dict[str, Union[int, str]]


def _int_or_zero(field: str) -> int:
    try:
        return int(field)
    except ValueError:
        return 0


def default_row_mapper(fields: List[str]) -> Row:
    """``{column name: value}`` of one split line: label and integer features as ``int`` (0 when empty
    or not a number), categorical features as the hex string (``""`` when empty), as torchrec's. A
    short line fills the *last* columns (torchrec pairs fields and names from the end)."""
    names = DEFAULT_COLUMN_NAMES[len(DEFAULT_COLUMN_NAMES) - len(fields) :]
    return {
        name: _int_or_zero(field) if not name.startswith("cat_") else field
        for name, field in zip(names, fields)
    }


def criteo_kaggle(
    path: str, *, row_mapper: Optional[Callable[[List[str]], object]] = default_row_mapper
) -> Iterator[object]:
    """The rows of a Criteo Kaggle ``train.txt`` / ``test.txt`` (or one Terabyte day), each through
    ``row_mapper`` (None: the split fields). Reads the file lazily, line by line."""
    with open(path) as lines:
        for line in lines:
            fields = line.rstrip("\n").split("\t")
            yield fields if row_mapper is None else row_mapper(fields)
