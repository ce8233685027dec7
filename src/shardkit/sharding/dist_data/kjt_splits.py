"""Phase one of the KJT all-to-all: what each rank sends where, and the header exchange that checks it.

Every rank sends every rank one fixed-size int64 header row (``HEADER`` fields). Because the row has
the same size whatever the input, the exchange itself cannot mismatch, and it carries both the sizes
phase two needs and what must agree between ranks (fingerprints of the keys and of the settings) plus
whether the rank's input passed its local checks. Every rank receives every rank's fingerprints and
status, so all ranks reach the same verdict and raise the same ``ValueError`` together; only then,
on that rare path, one more small gather fetches the details for the message.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from itertools import accumulate
from typing import List, Optional

import torch

from shardkit.distributed.agreement import format_per_rank, gather_objects
from shardkit.sparse import KeyedJaggedTensor

# fields of one header row, in order
# ("check": the sharded module's input verdict code carried along, ``InputVerdict.code``; else 0;
# "need": the sender's largest payload to any rank, in bytes, which sizes the slots: ``kjt_slots``)
HEADER = ("status", "keys", "settings", "lengths", "values", "batch", "num_keys", "check", "need")
_STATUS, _KEYS, _SETTINGS, _LENGTHS, _VALUES, _BATCH, _NUM_KEYS, _CHECK, _NEED = range(len(HEADER))
VARIABLE_BATCH = -1  # the "batch" field of a KJT with a variable batch size per feature


def fingerprint(obj: object) -> int:
    """A 56-bit hash of ``repr(obj)`` that is the same in every process (``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(obj).encode(), digest_size=7).digest(), "little")


@functools.lru_cache(maxsize=64)
def _cached_fingerprint(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


@dataclasses.dataclass
class SendPlan:
    """What this rank sends to each rank ``r``: keys ``key_bounds[r]:key_bounds[r + 1]`` of the input.

    ``lengths[r]`` / ``values[r]``: numbers of length entries / values (and weights) sent to ``r``;
    ``batch``: the input's stride, or ``VARIABLE_BATCH``; ``stride_per_key``: rows of each key (sent
    in phase two when the batch is variable).
    """

    keys: List[str]
    splits: List[int]
    key_bounds: List[int]
    lengths: List[int]
    values: List[int]
    batch: int
    stride_per_key: List[int]
    settings: tuple

    @property
    def weights_grad(self) -> bool:
        """Whether the weights' gradient flows back through the exchange."""
        return bool(self.settings[-1])

    @property
    def variable_batch(self) -> bool:
        return self.batch == VARIABLE_BATCH


def build_send_plan(
    input: KeyedJaggedTensor, splits: List[int], stagger: int, world: int, rank: int
) -> SendPlan:
    """Check this rank's arguments (no communication) and work out what goes where.

    Raises ``ValueError`` / ``TypeError`` naming the rank and the sizes. Reads ``length_per_key`` (one
    host sync unless the KJT has it cached).
    """
    where = f"KJTAllToAll on rank {rank}"
    if not isinstance(input, KeyedJaggedTensor):
        raise TypeError(f"{where}: input must be a KeyedJaggedTensor, got {type(input).__name__}")
    splits = [int(s) for s in splits]
    keys = list(input.keys())
    if len(splits) != world:
        raise ValueError(f"{where}: splits {splits} has {len(splits)} entries for a group of {world} ranks")
    if any(s < 0 for s in splits):
        raise ValueError(f"{where}: splits {splits} has a negative entry")
    if sum(splits) != len(keys):
        raise ValueError(
            f"{where}: splits {splits} sum to {sum(splits)}, but the input has {len(keys)} keys {keys}"
        )
    if stagger < 1 or world % stagger:
        raise ValueError(f"{where}: stagger {stagger} must be >= 1 and divide the world size {world}")
    bounds = [0, *accumulate(splits)]
    rows = input.stride_per_key()
    per_key = input.length_per_key()
    weights = input.weights_or_none()
    settings = (
        splits,
        stagger,
        str(input.values().dtype),
        str(input.lengths().dtype),
        None if weights is None else str(weights.dtype),
        input.variable_stride_per_key(),
        # backward exchanges the weights' gradient, so every rank must take part or none
        weights is not None and weights.requires_grad and torch.is_grad_enabled(),
    )
    return SendPlan(
        keys=keys,
        splits=splits,
        key_bounds=bounds,
        lengths=[sum(rows[a:b]) for a, b in zip(bounds, bounds[1:])],
        values=[sum(per_key[a:b]) for a, b in zip(bounds, bounds[1:])],
        batch=VARIABLE_BATCH if input.variable_stride_per_key() else input.stride(),
        stride_per_key=rows,
        settings=settings,
    )


def header_rows(
    plan: Optional[SendPlan], world: int, device: torch.device, check: int = 0, need: int = 0
) -> torch.Tensor:
    """``[world, len(HEADER)]`` int64: row ``r`` goes to rank ``r``. An invalid plan (None) sends status 1;
    ``check`` and ``need`` go in their fields."""
    if plan is None:
        row = [1] + [0] * (len(HEADER) - 1)
        return torch.tensor([row] * world, dtype=torch.int64, device=device)
    # the same keys and settings every step: the hashes come from a small cache (by their repr)
    keys, settings = _cached_fingerprint(repr(plan.keys)), _cached_fingerprint(repr(plan.settings))
    rows = [
        [0, keys, settings, plan.lengths[r], plan.values[r], plan.batch, plan.splits[r], check, need]
        for r in range(world)
    ]
    return torch.tensor(rows, dtype=torch.int64, device=device)


@dataclasses.dataclass
class Received:
    """What phase one tells rank ``me`` about each source rank ``s`` (lists indexed by ``s``)."""

    lengths: List[int]
    values: List[int]
    batch: List[int]


def largest_need(rows: List[List[int]]) -> int:
    """The largest payload any rank sends any rank (every rank receives every sender's ``need``, so
    every rank gets the same number)."""
    return max(row[_NEED] for row in rows)


def status_and_check(rows: List[List[int]]) -> List[tuple]:
    """Each source rank's ``(status, check)`` header fields."""
    return [(row[_STATUS], row[_CHECK]) for row in rows]


def check_headers(
    rows: List[List[int]],
    plan: Optional[SendPlan],
    error: Optional[BaseException],
    pg,
) -> Received:
    """Raise the same ``ValueError`` on every rank when any rank's input was invalid or ranks disagree.

    ``rows[s]`` is the header received from rank ``s``; ``plan`` / ``error`` this rank's own outcome.
    The verdict depends only on the fingerprints and statuses, which every rank receives from every
    rank, so all ranks take the same branch (and enter the same detail gather, if any).
    """
    if any(row[_STATUS] for row in rows):
        messages = gather_objects(None if error is None else f"{type(error).__name__}: {error}", pg)
        failed = "; ".join(m for m in messages if m)
        raise ValueError(f"KJTAllToAll: invalid input: {failed}") from error
    if any(row[_KEYS] != rows[0][_KEYS] for row in rows):
        keys = gather_objects(plan.keys, pg)
        raise ValueError(f"KJTAllToAll: ranks disagree on the keys of the input: {format_per_rank(keys)}")
    if any(row[_SETTINGS] != rows[0][_SETTINGS] for row in rows):
        names = (
            "splits",
            "stagger",
            "values dtype",
            "lengths dtype",
            "weights dtype",
            "variable batch",
            "weights requiring grad",
        )
        settings = gather_objects(plan.settings, pg)
        differ = [
            f"{name} ({format_per_rank([s[i] for s in settings])})"
            for i, name in enumerate(names)
            if any(s[i] != settings[0][i] for s in settings)
        ]
        raise ValueError(f"KJTAllToAll: ranks disagree on the {', '.join(differ)}")
    return Received(
        lengths=[row[_LENGTHS] for row in rows],
        values=[row[_VALUES] for row in rows],
        batch=[row[_BATCH] for row in rows],
    )


__all__ = [
    "HEADER",
    "Received",
    "SendPlan",
    "build_send_plan",
    "check_headers",
    "fingerprint",
    "header_rows",
    "largest_need",
    "status_and_check",
]
