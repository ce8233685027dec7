"""The sharded embedding modules' input check, run by every rank at the start of each forward.

``check_input`` raises the same ``ValueError`` on every rank when any rank's input is bad or the ranks
disagree on process-wide switches (one fixed-size all-gather per forward); ``feature_rows`` is the
per-plan part of it, which the modules compute once.
"""

from __future__ import annotations

import bisect
from itertools import accumulate
from typing import Callable, Dict, List, Optional

import torch

from shardkit.distributed.agreement import gather_objects
from shardkit.distributed.gather_blocks import all_gather_into
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.distributed.switches import result_switches, switch_disagreements
from shardkit.distributed.validation import validation_enabled
from shardkit.sharding.embedding_sharding import ShardedTable
from shardkit.sparse import KeyedJaggedTensor
from shardkit.sparse.validation import check_id_dtype, is_id_dtype


def feature_rows(
    tables: List[ShardedTable], source_feature: Optional[Dict[str, str]] = None
) -> Dict[str, int]:
    """Input feature -> the fewest rows among the tables that look it up (an id must fit each of them);
    ``source_feature`` maps the tables' feature names to the input's. Depends on the plan only: the
    sharded modules compute it once, not per forward."""
    rows: Dict[str, int] = {}
    for t in tables:
        for f in t.config.feature_names:
            f = f if source_feature is None else source_feature[f]
            rows[f] = min(rows.get(f, t.config.num_embeddings), t.config.num_embeddings)
    return rows


def check_input(
    features: KeyedJaggedTensor,
    tables: List[ShardedTable],
    weighted: bool,
    owner: str,
    env: ShardingEnv,
    extra_check: Optional[Callable[[KeyedJaggedTensor], None]] = None,
    source_feature: Optional[Dict[str, str]] = None,
    rows: Optional[Dict[str, int]] = None,
) -> None:
    """Raise ``ValueError`` on every rank if any rank's input is bad (``source_feature`` maps the
    tables' feature names to the input's, see ``one_name_per_lookup``): a missing or repeated feature
    (features no table looks up are ignored), negative lengths or lengths that do not sum to the
    values, a missing weight, ids of a non-integer dtype, an id outside its table, a variable batch
    per feature on some ranks only, or one without inverse indices; ``extra_check(features)`` may
    raise more. An exception of any type on any rank is reported on every rank, and so is a
    process-wide switch set differently on some ranks (``shardkit.distributed.switches``).

    One all-gather of a few integers (and one host sync) per forward, made whether validation is on
    or off, so that ranks set differently still make the same collectives; the error messages are
    gathered only when a rank failed. Validation off skips the content checks (lengths, id ranges)
    and their host sync. ``rows`` is ``feature_rows(tables, source_feature)`` when the caller keeps it.
    The sharded modules whose input dist starts with a KJT all-to-all skip this all-gather: they
    send :func:`input_verdict` in that all-to-all's header instead (``InputVerdict``)."""
    verdict = input_verdict(features, tables, weighted, owner, extra_check, source_feature, rows)
    rows_of_flags = [verdict.flags]
    if env.world_size > 1:
        device = features.values().device if isinstance(features, KeyedJaggedTensor) else torch.device("cpu")
        flags = verdict.flags
        out = torch.empty(env.world_size * len(flags), dtype=torch.int64, device=device)
        all_gather_into(out, torch.tensor(flags, dtype=torch.int64, device=device), group=env.process_group)
        rows_of_flags = out.view(env.world_size, len(flags)).tolist()
    verdict.judge(rows_of_flags, env.process_group if env.world_size > 1 else None)


class InputVerdict:
    """One rank's outcome of the local input checks, to be compared with every other rank's.

    ``error``: ``"Type: message"`` of the first failed check (None: passed); ``flags``: ``[failed,
    variable batch (-1 unknown, 0, 1), *process-wide switches]`` (ints). ``code()`` packs the flags but
    ``failed`` into one int64, so that the verdict can ride in another exchange's fixed-size header
    (the KJT all-to-all's, ``kjt_splits``) instead of costing a collective of its own.
    """

    def __init__(self, error: Optional[str], flags: List[int]) -> None:
        self.error = error
        self.flags = flags

    @property
    def failed(self) -> bool:
        return self.error is not None

    def code(self) -> int:
        """``variable + 1`` in bits 0-1, switch ``i`` in bit ``2 + i`` (fewer than 60 switches)."""
        code = self.flags[1] + 1
        for i, bit in enumerate(self.flags[2:]):
            code |= int(bit) << (2 + i)
        return code

    def flags_of(self, failed: int, code: int) -> List[int]:
        """Another rank's flags from its ``failed`` status and ``code()`` (this rank's switch count)."""
        switches = [(code >> (2 + i)) & 1 for i in range(len(self.flags) - 2)]
        return [int(bool(failed)), (code & 3) - 1, *switches]

    def judge(self, rows: List[List[int]], group, error: Optional[str] = None) -> None:
        """Raise the same ``ValueError`` on every rank unless every rank passed with these flags.

        ``rows``: every rank's flags, in rank order (the same on every rank); ``group``: where the
        messages are gathered when some rank failed (None: one rank); ``error``: this rank's message
        when its own verdict passed but what carried it failed (e.g. the KJT all-to-all's send plan).
        """
        flags = self.flags
        if self.error is None and all(row == flags for row in rows):
            return  # the common case: every rank passed, with the same flags as this one
        if any(row[0] for row in rows):
            mine = self.error or error
            errors = [mine] if group is None else gather_objects(mine, group)
            failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
            raise ValueError(f"invalid input: {failed}")
        switches = result_switches()
        differ = switch_disagreements([dict(zip(switches, map(bool, row[2:]))) for row in rows])
        if differ:
            raise ValueError("ranks disagree on process-wide settings: " + "; ".join(differ))
        if len({row[1] for row in rows}) > 1:
            per_rank = ", ".join(
                f"rank {r}: {bool(row[1]) if row[1] >= 0 else None}" for r, row in enumerate(rows)
            )
            raise ValueError(
                f"ranks disagree on whether the input has a variable batch per feature ({per_rank})"
            )


def input_verdict(
    features: KeyedJaggedTensor,
    tables: List[ShardedTable],
    weighted: bool,
    owner: str,
    extra_check: Optional[Callable[[KeyedJaggedTensor], None]] = None,
    source_feature: Optional[Dict[str, str]] = None,
    rows: Optional[Dict[str, int]] = None,
) -> InputVerdict:
    """This rank's part of :func:`check_input`: every local check, no communication; never raises."""
    error = None
    try:
        if rows is None:
            rows = feature_rows(tables, source_feature)
        keys = features.keys()
        key_set = set(keys)  # a set: a list's ``in`` made this check quadratic in the number of features
        if not key_set.issuperset(rows):  # C speed; the list of the missing ones only for the message
            missing = [f for f in rows if f not in key_set]
            raise KeyError(f"{owner}: input keys {keys} lack the feature(s) {missing}")
        if len(key_set) != len(keys):
            raise KeyError(f"{owner}: input keys {keys} contain a repeated key")
        if features.variable_stride_per_key() and features.inverse_indices_or_none() is None:
            raise ValueError(f"{owner}: a variable batch per feature needs the input's inverse_indices")
        if weighted and features.weights_or_none() is None:
            raise ValueError(f"{owner}: a weighted module needs a KeyedJaggedTensor with weights")
        # before any input dist: a float id would be truncated (or bucketized) on its way to a shard
        if not is_id_dtype(features.values().dtype):  # the names only for the message
            check_id_dtype(owner, features.values(), [f for f in keys if f in rows])
        if validation_enabled():
            _check_lengths(features, owner)
            _check_id_ranges(features, keys, rows, owner)
        if extra_check is not None:
            extra_check(features)
    except Exception as err:  # noqa: BLE001 - every failure must reach the agreement
        error = f"{type(err).__name__}: {err}"
    variable = features.variable_stride_per_key() if isinstance(features, KeyedJaggedTensor) else None
    switches = result_switches()
    flags = [int(error is not None), -1 if variable is None else int(variable), *map(int, switches.values())]
    return InputVerdict(error, flags)


def _check_id_ranges(features: KeyedJaggedTensor, keys: List[str], rows: Dict[str, int], owner: str) -> None:
    """``IndexError`` naming the first id (in value order) of a looked-up feature outside ``[0, rows)``;
    the ids of features no table looks up are not checked. One vectorized pass over all the ids and
    one host sync (a loop over the features cost two syncs and a few small ops per feature)."""
    ids = features.values()
    if ids.dim() != 1 or not ids.numel():
        for key, part in zip(keys, ids.split(features.length_per_key())):  # [N, D] values: per key
            if key in rows and part.numel() and (int(part.min()) < 0 or int(part.max()) >= rows[key]):
                bad = part[(part < 0) | (part >= rows[key])][0]
                raise IndexError(
                    f"{owner}: id {int(bad)} of feature {key!r} is out of range [0, {rows[key]})"
                )
        return
    per_key = features.length_per_key()
    unchecked = torch.iinfo(torch.int64)
    bounds = torch.tensor(
        [[0, rows[k]] if k in rows else [unchecked.min, unchecked.max] for k in keys], dtype=torch.int64
    ).to(ids.device)
    per_id = torch.repeat_interleave(
        bounds, torch.tensor(per_key, device=ids.device), dim=0, output_size=ids.numel()
    )
    bad = (ids < per_id[:, 0]) | (ids >= per_id[:, 1])
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        key = keys[bisect.bisect_right(list(accumulate(per_key)), position)]  # the key holding it
        raise IndexError(
            f"{owner}: id {int(ids[position])} of feature {key!r} is out of range [0, {rows[key]})"
        )


def _check_lengths(features: KeyedJaggedTensor, owner: str) -> None:
    """Lengths non-negative and summing to the number of values (one host sync): a KeyedJaggedTensor
    built with ``validate=False`` was never checked, and bad lengths fail inside a kernel or, sent
    on, on another rank."""
    lengths = features.lengths()
    if not lengths.numel():
        smallest, total = 0, 0
    else:
        smallest, total = torch.stack([lengths.min(), lengths.sum()]).tolist()
    if smallest < 0:
        raise ValueError(f"{owner}: the input has a negative length ({smallest})")
    if total != features.values().numel():
        raise ValueError(
            f"{owner}: the input's lengths sum to {total} but it has {features.values().numel()} values"
        )


__all__ = ["InputVerdict", "check_input", "feature_rows", "input_verdict"]
