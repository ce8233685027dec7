"""Cache configuration of the offloading kernels (``fused_uvm_caching``, ``quant_uvm_caching``, ...).

torchrec's names, as its ``torchrec.distributed.types`` and fbgemm spell them:

- :class:`CacheAlgorithm` (``LRU``, ``LFU``): the replacement rule of a table's cache;
- :class:`CacheParams`: the cache options of one table (``ParameterSharding.cache_params``,
  ``ParameterConstraints.cache_params``), hashable like torchrec's (``stats`` is left out of the hash);
- :class:`CacheStatistics`: what a planner knows of a table's access pattern (expected distinct lookups
  per step, expected miss rate for a load factor, cacheability), abstract as in torchrec.

shardkit adds:

- :class:`SampledCacheStatistics` (also ``CacheStatistics.from_ids``): the statistics of a sample of ids,
  with the exact LRU miss-ratio curve of that sample (stack distances);
- :func:`cache_params_from_fused_params`: the ``CacheParams`` that torchrec's ``fused_params`` keys
  (``cache_load_factor``, ``cache_algorithm``, ``cache_precision``, ``prefetch_pipeline``,
  ``cache_reserved_memory``, ``multipass_prefetch_config``) and shardkit's ``offload_dir`` describe,
  merged with the plan's ``cache_params`` (the plan's fields win, as torchrec's
  ``add_params_from_parameter_sharding``);
- :func:`cache_rows`: how many rows a cache of a given load factor holds (one rule for the storage and
  the planner); :data:`DEFAULT_CACHE_LOAD_FACTOR` (0.2, fbgemm's default).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
import numbers
import os
from typing import Any, Dict, Mapping, Optional, Sequence, Union

import torch

from shardkit.modules.embedding_configs import DataType

# fbgemm's default ``cache_load_factor`` (and torchrec's planner's caching ratio)
DEFAULT_CACHE_LOAD_FACTOR = 0.2

# the environment variable that chooses the offload directory when neither ``CacheParams.offload_dir``
# nor ``fused_params["offload_dir"]`` does (the storage's default is a per-run temporary directory)
OFFLOAD_DIR_ENV = "SHARDKIT_OFFLOAD_DIR"


class CacheAlgorithm(enum.Enum):
    """Replacement rule of a table's cache (fbgemm's values): evict the least recently used row (LRU) or
    the least frequently used one (LFU)."""

    LRU = 0
    LFU = 1


def _enum_member(value: Any, enum_type: type, what: str) -> Any:
    """``value`` as a member of ``enum_type``: a member, another enum's member of the same name (fbgemm's
    ``CacheAlgorithm``, torchrec's ``DataType``), or a name / value string (case-insensitive name)."""
    if isinstance(value, enum_type):
        return value
    if isinstance(value, enum.Enum):
        value = value.name
    if isinstance(value, str):
        for member in enum_type:
            if value.upper() == member.name or value == member.value:
                return member
    known = [m.name for m in enum_type]
    raise ValueError(f"{what}: {value!r} is not a {enum_type.__name__}; known: {known}")


def _check_load_factor(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what}: the cache load factor must be a number in (0, 1], got {value!r}")
    value = float(value)
    if not 0.0 < value <= 1.0:  # also rejects nan
        raise ValueError(
            f"{what}: the cache load factor must be in (0, 1] (the share of a table's rows the cache "
            f"holds), got {value}"
        )
    return value


@dataclasses.dataclass
class CacheParams:
    """Cache options of one embedding table, for the offloading kernels.

    Attributes (all optional; None leaves the choice to ``fused_params`` or the default):
        algorithm: :class:`CacheAlgorithm` replacement rule (default LRU). A member of fbgemm's enum or
            the name ``"lru"`` / ``"lfu"`` is converted.
        load_factor: share of the table's rows (of each shard's rows, for a sharded table) that the cache
            holds, in (0, 1]; default :data:`DEFAULT_CACHE_LOAD_FACTOR`. :func:`cache_rows` gives the
            number of rows.
        reserved_memory: fbgemm's ``cache_reserved_memory`` (GiB of device memory kept free of the
            cache, >= 0); carried to the kernels, which use it only where they size a cache from free
            device memory.
        precision: :class:`~shardkit.modules.DataType` of the cached rows (a ``DataType`` value string is
            converted).
        prefetch_pipeline: the training pipeline prefetches the next batch's rows into the cache
            (``PrefetchTrainPipelineSparseDist``).
        stats: :class:`CacheStatistics` of the table's ids, for the planner (not part of the hash).
        multipass_prefetch_config: fbgemm's ``MultiPassPrefetchConfig`` (any hashable value); carried,
            for torchrec compatibility.
        offload_dir: shardkit's addition: directory of the CPU backing files (default
            ``$SHARDKIT_OFFLOAD_DIR``, else a per-run temporary directory).

    Raises ``ValueError`` / ``TypeError`` at construction for a load factor outside (0, 1], an unknown
    algorithm or precision, a negative reserved memory, or a non-bool ``prefetch_pipeline``.
    """

    algorithm: Optional[CacheAlgorithm] = None
    load_factor: Optional[float] = None
    reserved_memory: Optional[float] = None
    precision: Optional[DataType] = None
    prefetch_pipeline: Optional[bool] = None
    stats: Optional[CacheStatistics] = None
    multipass_prefetch_config: Optional[Any] = None
    offload_dir: Optional[str] = None

    def __post_init__(self) -> None:
        if self.algorithm is not None:
            self.algorithm = _enum_member(self.algorithm, CacheAlgorithm, "CacheParams.algorithm")
        if self.load_factor is not None:
            self.load_factor = _check_load_factor(self.load_factor, "CacheParams.load_factor")
        if self.reserved_memory is not None:
            if isinstance(self.reserved_memory, bool) or not isinstance(self.reserved_memory, numbers.Real):
                raise TypeError(f"CacheParams.reserved_memory must be a number, got {self.reserved_memory!r}")
            if not self.reserved_memory >= 0:
                raise ValueError(f"CacheParams.reserved_memory must be >= 0, got {self.reserved_memory}")
            self.reserved_memory = float(self.reserved_memory)
        if self.precision is not None:
            self.precision = _enum_member(self.precision, DataType, "CacheParams.precision")
        if self.prefetch_pipeline is not None and not isinstance(self.prefetch_pipeline, bool):
            raise TypeError(f"CacheParams.prefetch_pipeline must be a bool, got {self.prefetch_pipeline!r}")
        if self.stats is not None and not isinstance(self.stats, CacheStatistics):
            raise TypeError(f"CacheParams.stats must be a CacheStatistics, got {type(self.stats).__name__}")
        if self.offload_dir is not None:
            if not isinstance(self.offload_dir, (str, bytes)) and not hasattr(self.offload_dir, "__fspath__"):
                raise TypeError(f"CacheParams.offload_dir must be a path, got {self.offload_dir!r}")
            self.offload_dir = os.fsdecode(os.fspath(self.offload_dir))

    def __hash__(self) -> int:
        # as torchrec: every field but the statistics (which may hold a large sample)
        return hash(
            (
                self.algorithm,
                self.load_factor,
                self.reserved_memory,
                self.precision,
                self.prefetch_pipeline,
                self.multipass_prefetch_config,
                self.offload_dir,
            )
        )


class CacheStatistics(abc.ABC):
    """What a planner knows of a table's access pattern (torchrec's interface)."""

    @property
    @abc.abstractmethod
    def expected_lookups(self) -> float:
        """Expected number of cache lookups per training step: the expected number of distinct ids in a
        global training batch."""

    @abc.abstractmethod
    def expected_miss_rate(self, clf: float) -> float:
        """Expected share of lookups that miss a cache of load factor ``clf``: 1.0 at ``clf`` 0, 0.0 at
        ``clf`` 1, in between an estimate from the access pattern."""

    @property
    @abc.abstractmethod
    def cacheability(self) -> float:
        """How hard the ids are to cache, whatever the cache size: 0 very cacheable (high locality), 1
        very hard."""

    @staticmethod
    def from_ids(
        ids: Union[torch.Tensor, Sequence[torch.Tensor]], num_rows: int, cold_misses: bool = False
    ) -> SampledCacheStatistics:
        """:class:`SampledCacheStatistics` of a sample of ids (see there)."""
        return SampledCacheStatistics(ids, num_rows, cold_misses)


def _prefix_counts_greater(keys: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """For every t: ``#{j < t : keys[j] > thresholds[t]}`` (int64 ``[n]``), in ``O(n log^2 n)`` torch ops.

    ``[0, t)`` is the union of the aligned blocks ``[(t >> k) - 1] << k`` of size ``2**k`` for the set
    bits k of t; each level sorts the keys within its blocks once and counts by binary search.
    ``keys`` and ``thresholds`` are int64 in ``[-1, n)``.
    """
    n = keys.numel()
    out = torch.zeros(n, dtype=torch.int64)
    if n == 0:
        return out
    t = torch.arange(n, dtype=torch.int64)
    span = n + 2  # keys + 1 lie in [0, n]: blocks never mix in the combined sort key
    level = 0
    while (1 << level) <= n:
        block = t >> level
        combined, _ = torch.sort(block * span + (keys + 1))
        use = ((t >> level) & 1) == 1
        if bool(use.any()):
            b = block[use] - 1
            base = b * span
            above = torch.searchsorted(combined, base + thresholds[use] + 1, right=True)
            end = torch.searchsorted(combined, base + span - 1, right=True)
            out[use] += end - above
        level += 1
    return out


def lru_stack_distances(ids: torch.Tensor) -> torch.Tensor:
    """LRU stack distance of each access of the stream ``ids`` (int64 ``[n]``).

    The distance of an access is 1 + the number of distinct other ids accessed since the previous
    access of the same id: an LRU cache of ``C`` rows hits exactly the accesses of distance ``<= C``.
    A first access has distance 0 (no previous access: a miss at every size).
    """
    ids = torch.as_tensor(ids).reshape(-1).to(torch.int64)
    n = ids.numel()
    prev = torch.full((n,), -1, dtype=torch.int64)
    if n > 1:
        order = torch.sort(ids, stable=True).indices
        same = ids[order[1:]] == ids[order[:-1]]
        prev[order[1:][same]] = order[:-1][same]
    # distinct ids in the window (p, t) = accesses in it minus repeats, a repeat being an access j < t
    # whose own previous access lies after p
    repeats = _prefix_counts_greater(prev, prev)
    t = torch.arange(n, dtype=torch.int64)
    distance = (t - prev - 1) - repeats + 1
    return torch.where(prev >= 0, distance, torch.zeros_like(distance))


def _censored_miss_curve(distances: torch.Tensor, distinct: int) -> torch.Tensor:
    """Kaplan-Meier estimate of ``P(stack distance > c)``, c = 0 .. ``distinct`` (float64
    ``[distinct + 1]``), from one pass's LRU stack distances (:func:`lru_stack_distances`, 0 for a
    first access).

    An access with a previous one in the sample has its distance (an *event* at that distance). A first
    access at position t has a distance larger than ``D(t)``, the distinct ids before t (right-censored
    at ``D(t)``): it is at risk for the distances ``1 .. D(t)`` only. The hazard at d is the events at d
    over the accesses at risk at d; the survival is the product of ``1 - hazard`` up to c. At c = 0 it is
    1 (an empty cache misses everything); past the largest distance at risk it stays flat.
    """
    first = distances == 0
    before = torch.cumsum(first, 0) - first.to(torch.int64)  # D(t): distinct ids before t
    size = distinct + 1
    events = torch.bincount(distances[~first], minlength=size).to(torch.float64)
    censored = torch.bincount(before[first], minlength=size).to(torch.float64)

    def at_least(counts: torch.Tensor) -> torch.Tensor:  # [d] -> #{x >= d}
        return torch.flip(torch.cumsum(torch.flip(counts, [0]), 0), [0])

    at_risk = at_least(events) + at_least(censored)
    hazard = torch.where(at_risk > 0, events / at_risk.clamp(min=1.0), torch.zeros_like(events))
    hazard[0] = 0.0
    return torch.cumprod(1.0 - hazard, 0)


class SampledCacheStatistics(CacheStatistics):
    """:class:`CacheStatistics` measured on a sample of a table's ids.

    Args:
        ids: the ids looked up in a few training steps, in order: a sequence of 1-D integer tensors (one
            per step, global batch) or one 1-D tensor (one step). Values in ``[0, num_rows)``.
        num_rows: the table's rows.
        cold_misses: False (default): the miss-ratio curve of a *warm* LRU cache on a stationary stream
            of which the ids are a sample (a training run's cache after its first steps), estimated
            from the sample's LRU stack distances. An access whose id occurred earlier in the sample has
            a known distance; a first access has a distance larger than the number of distinct ids
            before it in the sample, nothing more is known (it is *censored*: its previous access lies
            before the sample). The curve is the Kaplan-Meier estimate of the distances' distribution
            under that censoring: unbiased for caches of up to :attr:`informed_rows` rows (the
            sample's distinct ids), flat beyond (an upper bound: the sample says nothing of larger
            caches), 0 at the whole table. True: an LRU cache that starts empty and reads the sample
            once: every first access is a miss at any cache smaller than the table (the curve stays at
            least ``distinct ids / ids`` until it drops to 0 at the whole table); the cold start of a
            run, pessimistic for its steady state.

    Before: the warm curve replayed the sample as a cyclic stream (the sample twice, counting the
    second pass). That counts a first access as a hit in any cache holding the sample's distinct ids,
    so a cache larger than the sample's distinct ids was predicted to miss nothing: for Zipf(1.05) ids
    over 10^5 rows and a sample of 10 steps of 4,096 ids (10,967 distinct), 0 % misses at load factor
    0.2 against 14.2 % per id measured on a warm ``RowCache`` (the censored estimate: 20 %, flat from
    the sample's 10,967 rows; from 30 steps, 23,690 distinct: 14.4 %). Within :attr:`informed_rows`
    both agree; use a sample with more distinct ids than the largest cache asked about.

    Miss ratios are per id looked up (an id repeated in a step counts each time, as the planner's cost
    model counts lookups); the cache's own ``hit_rate`` (``cache_stats()``) counts each distinct row of
    a step once: the misses are the same, ``misses / ids`` is the comparable figure.

    :meth:`miss_ratio(rows)` is given at every integer cache size (exact for the cold curve);
    :meth:`expected_miss_rate(clf)` is linear between the integer sizes around ``clf * num_rows``.
    LFU caches are estimated with the LRU curve (no exact curve exists for LFU). The sample should
    hold more distinct ids than the largest cache it is asked about; the cost is ``O(n log^2 n)`` torch
    ops (about a second for 10^6 ids).

    Raises ``ValueError`` for an empty sample, ids out of range or a non-positive ``num_rows``;
    ``TypeError`` for non-integer ids.
    """

    def __init__(
        self, ids: Union[torch.Tensor, Sequence[torch.Tensor]], num_rows: int, cold_misses: bool = False
    ) -> None:
        if isinstance(num_rows, bool) or not isinstance(num_rows, numbers.Integral) or num_rows <= 0:
            raise ValueError(f"SampledCacheStatistics: num_rows must be a positive int, got {num_rows!r}")
        steps = [ids] if isinstance(ids, torch.Tensor) else list(ids)
        flat = []
        for i, step in enumerate(steps):
            step = torch.as_tensor(step)
            if step.is_floating_point() or step.is_complex() or step.dtype == torch.bool:
                raise TypeError(f"SampledCacheStatistics: step {i}'s ids must be integers, got {step.dtype}")
            flat.append(step.reshape(-1).to(torch.int64).cpu())
        stream = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.int64)
        if stream.numel() == 0:
            raise ValueError("SampledCacheStatistics: the sample has no ids")
        low, high = int(stream.min()), int(stream.max())
        if low < 0 or high >= num_rows:
            raise ValueError(
                f"SampledCacheStatistics: ids must lie in [0, {num_rows}), the sample has [{low}, {high}]"
            )
        self.num_rows = int(num_rows)
        self.num_ids = stream.numel()
        self.cold_misses = bool(cold_misses)
        self._lookups = sum(int(torch.unique(s).numel()) for s in flat if s.numel()) / len(flat)
        self.distinct_ids = int(torch.unique(stream).numel())
        distances = lru_stack_distances(stream)  # 0 for a first access
        if self.cold_misses:
            # hits[c]: accesses that an LRU cache of c rows hits, c = 0 .. the largest distance; beyond it
            # the curve is flat (up to the whole table, which misses nothing)
            counts = torch.bincount(distances, minlength=self.distinct_ids + 1)
            counts[0] = 0
            self._hits = torch.cumsum(counts, 0).to(torch.float64)
        else:
            self._hits = self.num_ids * (1.0 - _censored_miss_curve(distances, self.distinct_ids))

    @property
    def informed_rows(self) -> int:
        """The largest cache (rows) the sample says something about: its distinct ids. The warm curve
        is flat beyond it (see the class docstring)."""
        return self.distinct_ids

    @property
    def expected_lookups(self) -> float:
        """Mean number of distinct ids per step of the sample."""
        return self._lookups

    def miss_ratio(self, cache_rows: int) -> float:
        """Miss ratio (per id) of an LRU cache of ``cache_rows`` rows: warm on the stream the sample
        comes from (estimated), or reading the sample once from empty with ``cold_misses`` (exact); 0
        for a cache of the whole table."""
        if cache_rows >= self.num_rows:
            return 0.0
        c = min(max(int(cache_rows), 0), len(self._hits) - 1)
        return 1.0 - float(self._hits[c]) / self.num_ids

    def min_cache_rows(self, max_miss_ratio: float) -> int:
        """The smallest cache (rows) whose :meth:`miss_ratio` is at most ``max_miss_ratio``."""
        misses = self.num_ids - self._hits  # non-increasing in the cache size
        allowed = max_miss_ratio * self.num_ids + 1e-9 * self.num_ids
        reached = torch.nonzero(misses <= allowed)
        return min(int(reached[0, 0]), self.num_rows) if reached.numel() else self.num_rows

    def expected_miss_rate(self, clf: float) -> float:
        """Miss ratio of a cache of load factor ``clf`` (``clf * num_rows`` rows, linear between integer
        sizes); 1.0 at 0, 0.0 at 1."""
        if not 0.0 <= clf <= 1.0:
            raise ValueError(f"expected_miss_rate: the load factor must be in [0, 1], got {clf}")
        rows = clf * self.num_rows
        low = math.floor(rows)
        frac = rows - low
        miss = self.miss_ratio(low)
        if frac > 0.0:
            miss += frac * (self.miss_ratio(low + 1) - miss)
        return miss

    @property
    def cacheability(self) -> float:
        """Area under the miss-ratio curve over load factors in [0, 1]: 0 when one row serves all lookups,
        about 0.5 for ids uniform over the table, 1 when no cache smaller than the table hits (a scan)."""
        # the curve is linear between integer sizes, flat past the largest stack distance, and 0 at the
        # whole table
        miss = 1.0 - self._hits / self.num_ids
        last = len(miss) - 1
        if last >= self.num_rows:
            miss = miss[: self.num_rows + 1].clone()
            miss[self.num_rows] = 0.0
            return float(torch.trapezoid(miss)) / self.num_rows
        tail = float(miss[last]) * (self.num_rows - 1 - last + 0.5)
        return (float(torch.trapezoid(miss)) + tail) / self.num_rows

    def __repr__(self) -> str:
        return (
            f"SampledCacheStatistics(num_rows={self.num_rows}, num_ids={self.num_ids}, "
            f"distinct_ids={self.distinct_ids}, expected_lookups={self._lookups:g}, "
            f"cold_misses={self.cold_misses})"
        )


def cache_rows(num_rows: int, load_factor: float) -> int:
    """Rows a cache of ``load_factor`` keeps for a table (shard) of ``num_rows`` rows:
    ``round(load_factor * num_rows)``, at least 1 and at most ``num_rows`` (0 for an empty shard)."""
    if num_rows <= 0:
        return 0
    return max(1, min(int(num_rows), int(round(load_factor * num_rows))))


# fused_params key -> CacheParams field (torchrec's keys; offload_dir is shardkit's)
FUSED_PARAMS_KEYS: Dict[str, str] = {
    "cache_algorithm": "algorithm",
    "cache_load_factor": "load_factor",
    "cache_reserved_memory": "reserved_memory",
    "cache_precision": "precision",
    "prefetch_pipeline": "prefetch_pipeline",
    "multipass_prefetch_config": "multipass_prefetch_config",
    "offload_dir": "offload_dir",
}


def cache_params_from_fused_params(
    fused_params: Optional[Mapping[str, Any]], cache_params: Optional[CacheParams] = None
) -> Optional[CacheParams]:
    """The cache options of one table: ``fused_params``' cache keys, overridden by ``cache_params``.

    ``fused_params`` keys read (torchrec's, see :data:`FUSED_PARAMS_KEYS`): ``cache_load_factor``,
    ``cache_algorithm``, ``cache_precision``, ``prefetch_pipeline``, ``cache_reserved_memory``,
    ``multipass_prefetch_config``, and shardkit's ``offload_dir``. A ``"cache_params"`` entry (where
    ``add_params_from_parameter_sharding`` puts the plan's ``CacheParams``) counts as ``cache_params``.

    Every field that the explicit ``cache_params`` sets (not None) wins over the ``fused_params`` key,
    as torchrec's ``add_params_from_parameter_sharding`` lets the plan's ``ParameterSharding.cache_params``
    override the sharder's ``fused_params``. ``cache_params`` (the argument) wins over a
    ``fused_params["cache_params"]``. Returns None when neither names any cache option.

    Raises ``ValueError`` / ``TypeError`` naming the key for an invalid value.
    """
    fused = dict(fused_params or {})
    explicit = []
    nested = fused.pop("cache_params", None)
    for which, value in (('fused_params["cache_params"]', nested), ("cache_params", cache_params)):
        if value is None:
            continue
        if not isinstance(value, CacheParams):
            raise TypeError(f"{which} must be a CacheParams, got {type(value).__name__}")
        explicit.append(value)
    fields: Dict[str, Any] = {}
    for key, field in FUSED_PARAMS_KEYS.items():
        if fused.get(key) is None:
            continue
        try:
            CacheParams(**{field: fused[key]})
        except (TypeError, ValueError) as e:
            raise type(e)(f'fused_params["{key}"]: {e}') from None
        fields[field] = fused[key]
    for params in explicit:
        for f in dataclasses.fields(CacheParams):
            value = getattr(params, f.name)
            if value is not None:
                fields[f.name] = value
    if not fields:
        return None
    return CacheParams(**fields)


__all__ = [
    "DEFAULT_CACHE_LOAD_FACTOR",
    "FUSED_PARAMS_KEYS",
    "OFFLOAD_DIR_ENV",
    "CacheAlgorithm",
    "CacheParams",
    "CacheStatistics",
    "SampledCacheStatistics",
    "cache_params_from_fused_params",
    "cache_rows",
    "lru_stack_distances",
]
