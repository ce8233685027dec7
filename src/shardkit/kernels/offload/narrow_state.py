"""Which optimizer state fields of an offloaded table a CPU row cache keeps mapped in memory.

A *narrow* state (row-wise Adagrad's one float a row) costs a system call per miss read and a
read-modify-write per write-back when it moves by ``preadv`` / ``pwritev`` like the weights (about a
quarter of a miss's I/O, docs/offload/costs.md), but only a few bytes a table row to keep: its region of
the backing file stays mapped (``BackingStore.keep_fields_mapped``) and the cache copies its rows. Those
bytes grow with the TABLE's rows, not the cache's: kept only while they are small against the cache's
own buffers (:data:`NARROW_SHARE`), so that a rank's memory stays within its cache plus bounded buffers
whatever the table's size (docs/offload/memory.md, "The bound"). The planner counts them by the same rule
(``planner/estimators.py``).
"""

from __future__ import annotations

import math
import os
from typing import List, Mapping, Sequence, Tuple

import torch

# "1" / "on": narrow state fields kept mapped whatever their size; "0" / "off": never (they go through
# preadv / pwritev like the weights); "auto" / unset: kept while within NARROW_SHARE of the cache's bytes
KEEP_NARROW_STATE_ENV = "SHARDKIT_OFFLOAD_KEEP_NARROW_STATE"
# a state field of at most this many bytes a row is "narrow" (row-wise Adagrad: 4)
NARROW_STATE_BYTES = 8
# the narrow fields are kept mapped (auto) while their bytes over all the table's rows are at most this
# share of the cache's buffers (capacity x a row's bytes over all fields): a table of dim-64 rows with
# row-wise Adagrad keeps them up to about 8x its cache's rows, then moves them through the file
NARROW_SHARE = 1 / 8


def keep_narrow_state(narrow_bytes: float, cache_bytes: float) -> bool:
    """Whether narrow fields of ``narrow_bytes`` (over every table row) are kept mapped beside a cache of
    ``cache_bytes``: per ``$SHARDKIT_OFFLOAD_KEEP_NARROW_STATE`` (``1`` / ``on`` / ``true`` / ``yes``:
    always; ``0`` / ``off`` / ``false`` / ``no``: never; unset, empty or ``auto``: while ``narrow_bytes <=
    NARROW_SHARE x cache_bytes``); anything else is a ValueError naming the variable."""
    value = os.environ.get(KEEP_NARROW_STATE_ENV, "").strip().lower()
    if value in ("0", "off", "false", "no"):
        return False
    if value in ("1", "on", "true", "yes"):
        return True
    if value not in ("", "auto"):
        raise ValueError(
            f"${KEEP_NARROW_STATE_ENV}={value!r}: expected auto, 1 / on / true / yes or 0 / off / false / no"
        )
    return narrow_bytes <= NARROW_SHARE * cache_bytes


def narrow_state_fields(
    fields: Mapping[str, Tuple[Sequence[int], torch.dtype]], cache_rows: int
) -> List[str]:
    """The ``state.*`` fields of ``fields`` (name -> (shape ``[R, ...]``, dtype)) whose rows are at most
    :data:`NARROW_STATE_BYTES` bytes, if an offloaded cache of ``cache_rows`` rows on CPU keeps them mapped
    (:meth:`BackingStore.keep_fields_mapped`, :func:`keep_narrow_state`: their ``R`` rows' bytes against
    the cache's ``cache_rows`` rows of every field); else ``[]``."""
    out, narrow_bytes, row_bytes = [], 0, 0
    num_rows = 0
    for name, (shape, dtype) in fields.items():
        width = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
        row_bytes += width
        num_rows = shape[0] if len(shape) >= 1 else num_rows
        if name.startswith("state.") and len(shape) >= 1 and width <= NARROW_STATE_BYTES:
            out.append(name)
            narrow_bytes += width * shape[0]
    if not out or not keep_narrow_state(narrow_bytes, min(cache_rows, num_rows) * row_bytes):
        return []
    return out


__all__ = [
    "KEEP_NARROW_STATE_ENV",
    "NARROW_SHARE",
    "NARROW_STATE_BYTES",
    "keep_narrow_state",
    "narrow_state_fields",
]
