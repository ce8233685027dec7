"""Which optimizer state fields of an offloaded table a CPU row cache keeps mapped in memory.

A *narrow* state (row-wise Adagrad's one float a row) costs a system call per miss read and a
read-modify-write per write-back when it moves by ``preadv`` / ``pwritev`` like the weights (about a
quarter of a miss's I/O, docs/offload.md "Costs"), but only a few bytes a table row to keep: its region of
the backing file stays mapped (``BackingStore.keep_fields_mapped``)
and the cache copies its rows. The planner counts those bytes (``planner/estimators.py``).
"""

from __future__ import annotations

import math
import os
from typing import List, Mapping, Sequence, Tuple

import torch

# "0" / "off": narrow optimizer state fields go through preadv / pwritev like the weights (not kept mapped)
KEEP_NARROW_STATE_ENV = "SHARDKIT_OFFLOAD_KEEP_NARROW_STATE"
# a state field of at most this many bytes a row is "narrow" (row-wise Adagrad: 4)
NARROW_STATE_BYTES = 8


def narrow_state_fields(fields: Mapping[str, Tuple[Sequence[int], torch.dtype]]) -> List[str]:
    """The ``state.*`` fields of ``fields`` whose rows are at most :data:`NARROW_STATE_BYTES` bytes: those
    an offloaded cache on CPU keeps mapped (:meth:`BackingStore.keep_fields_mapped`), unless
    ``$SHARDKIT_OFFLOAD_KEEP_NARROW_STATE`` is ``0`` / ``off`` / ``false`` / ``no`` (then none; unset,
    empty, ``1`` / ``on`` / ``true`` / ``yes``: on; anything else is a ValueError naming the variable)."""
    value = os.environ.get(KEEP_NARROW_STATE_ENV, "").strip().lower()
    if value in ("0", "off", "false", "no"):
        return []
    if value not in ("", "1", "on", "true", "yes"):
        raise ValueError(
            f"${KEEP_NARROW_STATE_ENV}={value!r}: expected 1 / on / true / yes or 0 / off / false / no"
        )
    out = []
    for name, (shape, dtype) in fields.items():
        row_bytes = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
        if name.startswith("state.") and len(shape) >= 1 and row_bytes <= NARROW_STATE_BYTES:
            out.append(name)
    return out


__all__ = ["KEEP_NARROW_STATE_ENV", "NARROW_STATE_BYTES", "narrow_state_fields"]
