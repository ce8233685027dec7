"""Managed collision modules: unbounded raw ids -> slots of a fixed-size table (unsharded, L1).

:class:`ManagedCollisionModule` is the interface (``preprocess`` -> ``profile`` -> ``remap``, ``evict``),
:class:`MCHManagedCollisionModule` the implementation: ``zch_size`` slots cut into ``buckets`` equal
buckets, each an independent sorted id -> slot map with one reserved *miss slot* (its last), the ids
routed to buckets by hashed-id range. Semantics, tie breaking and determinism: docs/managed_collision.md.

State (``state_dict``), ``[zch_size]`` int64 each, bucket ``b`` in ``[b * S, (b + 1) * S)`` with
``S = zch_size / buckets``, sorted by raw id within the bucket:
``_mch_sorted_raw_ids`` (empty slots hold ``2**63 - 1``), ``_mch_remapped_ids_mapping`` (the slot of
each entry, global: ``output_global_offset`` included), ``_mch_<metadata>`` of the eviction policy;
plus ``_current_iter_tensor`` ``[1]`` (profile calls so far) and ``_buckets_tensor`` ``[1]`` (checked on
load). A row-wise shard of the table holds exactly the slices of its rows: the state shards like rows.
"""

from __future__ import annotations

import abc
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from shardkit.distributed.validation import host_checks_enabled
from shardkit.modules.mc_eviction import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    MCHEvictionPolicy,
    MCHEvictionPolicyMetadataInfo,
    average_threshold_filter,
    dynamic_threshold_filter,
)
from shardkit.modules.mc_state import (
    EMPTY_SLOT_ID,
    MCHStateChecks,
    validate_after_load,
    window_from_state_dict,
    window_to_state_dict,
)
from shardkit.sparse import JaggedTensor

_Iterations = Union[int, torch.Tensor]  # one iteration for a piece of ids, or one per id
DEFAULT_INPUT_HASH_SIZE = 2**63 - 1


class ManagedCollisionModule(nn.Module):
    """Maps raw ids to ``[0, output_size())``; ``forward = remap(profile(preprocess(features)))``.

    Args:
        device: where the state lives.
    """

    def __init__(self, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self._device = torch.device(device or "cpu")

    @property
    def device(self) -> torch.device:
        return self._device

    @abc.abstractmethod
    def preprocess(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        """Ids as the map sees them (hashed into ``[0, input_size())`` if the module hashes)."""

    @abc.abstractmethod
    def profile(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        """Record the ids (training only); may evict. Returns ``features`` unchanged."""

    @abc.abstractmethod
    def remap(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        """Ids replaced by their slots; lengths, offsets and weights kept."""

    @abc.abstractmethod
    def evict(self) -> Optional[torch.Tensor]:
        """Slots whose id changed since the last call (sorted, int64), or None if none did."""

    @abc.abstractmethod
    def output_size(self) -> int:
        """Number of slots (the table's rows)."""

    @abc.abstractmethod
    def input_size(self) -> int:
        """Ids are in ``[0, input_size())`` after ``preprocess``."""

    @abc.abstractmethod
    def buckets(self) -> int:
        """Independent buckets the slots are cut into (the unit of row-wise sharding)."""

    @abc.abstractmethod
    def open_slots(self) -> torch.Tensor:
        """Number of empty slots (the reserved miss slots not counted), ``[1]`` int64."""

    @abc.abstractmethod
    def validate_state(self) -> None:
        """Raise ``ValueError`` if the state is not a valid map (after loading a checkpoint)."""

    def forward(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        return self.remap(self.profile(self.preprocess(features)))


class MCHManagedCollisionModule(MCHStateChecks, ManagedCollisionModule):
    """Zero-collision hash: each id seen often enough gets a slot of its own.

    Args:
        zch_size: slots (the table's ``num_embeddings``); divisible by ``buckets``.
        device: where the state lives.
        eviction_policy: LFU / LRU / DistanceLFU (``shardkit.modules.mc_eviction``).
        eviction_interval: evict every this many ``profile`` calls (iterations ``k * interval``).
        input_hash_size: ids (after ``input_hash_func``) are in ``[0, input_hash_size)``.
        input_hash_func: ``f(ids int64 [N], input_hash_size) -> [N]`` applied by ``preprocess``
            (None: ids are used as they are and must already be in range).
        mch_size, mch_hash_func: accepted for compatibility, must be None (no residual hash table).
        name: used in error messages.
        output_global_offset: added to every slot (set when a shard is rebuilt for its rows).
        output_segments: accepted for compatibility; the row ranges come from the sharder.
        buckets: independent buckets; a bucket holds ``zch_size / buckets`` slots, the last one its
            miss slot, and the ids ``[b * B, (b + 1) * B)`` with ``B = ceil(input_hash_size / buckets)``.

    forward(features: ``{name: JaggedTensor of int64 ids}``) -> same with slot ids in
    ``[output_global_offset, output_global_offset + zch_size)``.
    """

    def __init__(
        self,
        zch_size: int,
        device: Optional[torch.device],
        eviction_policy: MCHEvictionPolicy,
        eviction_interval: int,
        input_hash_size: int = DEFAULT_INPUT_HASH_SIZE,
        input_hash_func: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None,
        mch_size: Optional[int] = None,
        mch_hash_func: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None,
        name: Optional[str] = None,
        output_global_offset: int = 0,
        output_segments: Optional[List[int]] = None,
        buckets: int = 1,
        _first_bucket: int = 0,
        _total_buckets: Optional[int] = None,
    ) -> None:
        super().__init__(device)
        label = f"MCHManagedCollisionModule {name!r}" if name else "MCHManagedCollisionModule"
        if mch_size is not None or mch_hash_func is not None:
            raise ValueError(f"{label}: mch_size / mch_hash_func (a residual hash table) are not supported")
        if zch_size <= 0 or buckets <= 0 or zch_size % buckets:
            raise ValueError(
                f"{label}: zch_size {zch_size} must be positive and divisible by buckets {buckets}"
            )
        if eviction_interval <= 0:
            raise ValueError(f"{label}: eviction_interval must be positive, got {eviction_interval}")
        total = buckets if _total_buckets is None else _total_buckets
        if not 0 < input_hash_size <= DEFAULT_INPUT_HASH_SIZE or input_hash_size < total:
            raise ValueError(f"{label}: input_hash_size {input_hash_size} must be in [buckets, 2**63 - 1]")
        self._name, self._label = name, label
        self._zch_size, self._buckets = zch_size, buckets
        self._bucket_size = zch_size // buckets
        self._first_bucket, self._total_buckets = _first_bucket, total
        self._bucket_id_range = -(-input_hash_size // total)  # ceil
        self._input_hash_size, self._input_hash_func = input_hash_size, input_hash_func
        self._eviction_policy, self._eviction_interval = eviction_policy, eviction_interval
        self._output_global_offset = output_global_offset
        dev = self.device
        self.register_buffer("_mch_sorted_raw_ids", torch.full((zch_size,), EMPTY_SLOT_ID, device=dev))
        self.register_buffer(
            "_mch_remapped_ids_mapping",
            torch.arange(output_global_offset, output_global_offset + zch_size, device=dev),
        )
        for metadata in eviction_policy.metadata_names:
            self.register_buffer(f"_mch_{metadata}", torch.zeros(zch_size, dtype=torch.int64, device=dev))
        self.register_buffer("_current_iter_tensor", torch.zeros(1, dtype=torch.int64, device=dev))
        self.register_buffer("_buckets_tensor", torch.tensor([total], dtype=torch.int64, device=dev))
        # ids seen since the last eviction, per bucket: (ids, iteration or per-id iterations) pieces;
        # in the state dict as each bucket's window (see window_state), so a resume at any step is exact
        self._history: List[List[Tuple[torch.Tensor, _Iterations]]] = [[] for _ in range(buckets)]
        self._evicted: List[torch.Tensor] = []
        self._loaded_windows: Dict[int, torch.Tensor] = {}
        self.register_state_dict_post_hook(window_to_state_dict)
        self.register_load_state_dict_pre_hook(window_from_state_dict)
        self.register_load_state_dict_post_hook(validate_after_load)

    # ---- sizes --------------------------------------------------------------------------------

    def output_size(self) -> int:
        return self._zch_size

    def input_size(self) -> int:
        return self._input_hash_size

    def buckets(self) -> int:
        return self._buckets

    @property
    def eviction_policy(self) -> MCHEvictionPolicy:
        return self._eviction_policy

    @property
    def eviction_interval(self) -> int:
        return self._eviction_interval

    def bucket_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Global bucket ``[N]`` of preprocessed ids (``id // ceil(input_hash_size / total buckets)``)."""
        return torch.div(ids, self._bucket_id_range, rounding_mode="floor")

    def config(self) -> tuple:
        """What ranks compare to agree on this module's configuration."""
        return (
            self._zch_size,
            self._total_buckets,
            self._input_hash_size,
            self._input_hash_func is None,
            self._eviction_interval,
            self._eviction_policy.config(),
        )

    # ---- the three steps ----------------------------------------------------------------------

    def preprocess(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        if self._input_hash_func is not None:
            features = {
                name: _with_values(jt, self._input_hash_func(jt.values(), self._input_hash_size))
                for name, jt in features.items()
            }
        return features

    def check_ids(self, ids: torch.Tensor, what: str = "") -> None:
        """``ValueError`` naming the module if a preprocessed id is outside ``[0, input_hash_size)``
        or (a shard's module) outside its buckets. One host sync; skipped when validation is off."""
        if not host_checks_enabled() or ids.numel() == 0:
            return
        if ids.dtype != torch.int64:
            raise ValueError(f"{self._label}: ids{what} must be int64, got {ids.dtype}")
        low, high = self._first_bucket * self._bucket_id_range, self._input_hash_size
        if self._first_bucket + self._buckets < self._total_buckets:
            high = (self._first_bucket + self._buckets) * self._bucket_id_range
        lo, hi = int(ids.min()), int(ids.max())
        if lo < low or hi >= high:
            bad = lo if lo < low else hi
            hint = "" if self._input_hash_func is not None else " (give an input_hash_func to hash raw ids)"
            raise ValueError(f"{self._label}: id {bad}{what} is outside [{low}, {high}){hint}")

    def profile(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        if not self.training:
            return features
        ids = [jt.values() for jt in features.values()]
        self.profile_ids(torch.cat(ids) if len(ids) != 1 else ids[0])
        return features

    @torch.no_grad()
    def profile_ids(self, ids: torch.Tensor) -> None:
        """Record one iteration's preprocessed ids ``[N]`` int64 (all features of the table); evicts
        when the iteration is a multiple of ``eviction_interval``."""
        self.check_ids(ids)
        self._current_iter_tensor += 1
        current_iter = int(self._current_iter_tensor)
        for bucket, bucket_ids in enumerate(self._split_by_bucket(ids)):
            self._history[bucket].append((bucket_ids, current_iter))
        if current_iter % self._eviction_interval == 0:
            for bucket in range(self._buckets):
                self._evict_bucket(bucket, current_iter)

    def remap(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        return {name: _with_values(jt, self.remap_ids(jt.values())) for name, jt in features.items()}

    @torch.no_grad()
    def remap_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot ``[N]`` int64 of each preprocessed id: its own slot, or its bucket's miss slot."""
        self.check_ids(ids)
        if self._buckets == 1:
            return self._remap_bucket(0, ids)
        out = torch.empty_like(ids)
        local = self.bucket_of(ids) - self._first_bucket
        for bucket in range(self._buckets):
            where = (local == bucket).nonzero().squeeze(1)
            out[where] = self._remap_bucket(bucket, ids[where])
        return out

    def _remap_bucket(self, bucket: int, ids: torch.Tensor) -> torch.Tensor:
        sorted_ids, mapping, _ = self._bucket_views(bucket)
        position = torch.searchsorted(sorted_ids[:-1], ids)
        hit = sorted_ids[position] == ids
        return torch.where(hit, mapping[position], self._miss_slot(bucket))

    def _miss_slot(self, bucket: int) -> int:
        return self._output_global_offset + (bucket + 1) * self._bucket_size - 1

    def _split_by_bucket(self, ids: torch.Tensor) -> List[torch.Tensor]:
        if self._buckets == 1:
            return [ids]
        local = self.bucket_of(ids) - self._first_bucket
        return [ids[local == bucket] for bucket in range(self._buckets)]

    def _bucket_views(self, bucket: int) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
        rows = slice(bucket * self._bucket_size, (bucket + 1) * self._bucket_size)
        metadata = {m: getattr(self, f"_mch_{m}")[rows] for m in self._eviction_policy.metadata_names}
        return self._mch_sorted_raw_ids[rows], self._mch_remapped_ids_mapping[rows], metadata

    # ---- eviction -----------------------------------------------------------------------------

    def _window(self, bucket: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(unique ids, their counts, their last iteration) of the bucket's history; clears it."""
        window = self._aggregate(bucket)
        self._history[bucket] = []
        return window

    def _aggregate(self, bucket: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(unique ids ascending, their counts, their last iteration) of the bucket's history."""
        pieces = self._history[bucket]
        dev = self._mch_sorted_raw_ids.device
        ids = torch.cat([p for p, _ in pieces]) if pieces else torch.empty(0, dtype=torch.int64, device=dev)
        iters = (
            torch.cat([torch.full_like(p, it) if isinstance(it, int) else it for p, it in pieces])
            if pieces
            else ids
        )
        unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        last = torch.zeros_like(unique).scatter_reduce_(0, inverse, iters, "amax", include_self=False)
        return unique, counts, last

    def _evict_bucket(self, bucket: int, current_iter: int) -> None:
        policy = self._eviction_policy
        unique, counts, last = self._window(bucket)
        if policy.threshold_filtering_func is not None:
            keep = policy.threshold_filtering_func(counts)[0]
            unique, counts, last = unique[keep], counts[keep], last[keep]
        # candidates from the window: most frequent first, equal counts by ascending id
        order = torch.argsort(counts, descending=True, stable=True)
        unique, counts, last = unique[order], counts[order], last[order]
        sorted_ids, mapping, slot_meta = self._bucket_views(bucket)
        position = torch.searchsorted(sorted_ids[:-1], unique)
        held = sorted_ids[position] == unique
        window_meta = {"counts": counts, "last_access_iter": last}
        if "counts" in slot_meta:
            slot_meta["counts"].index_add_(0, position[held], counts[held])
        if "last_access_iter" in slot_meta:
            slot_meta["last_access_iter"][position[held]] = last[held]
        new = ~held
        new_ids = unique[new]
        if new_ids.numel() == 0:
            return  # nothing can displace an entry
        new_meta = {m: window_meta[m][new] for m in slot_meta}
        slot_scores = policy.eviction_scores(current_iter, slot_meta)
        slot_scores[-1] = float("inf")  # the miss slot always stays
        # only the len(new_ids) lowest-scored entries can lose their slot (all ties with the last of
        # them included): rank those with the window's ids, in the full ranking's relative order
        size = self._bucket_size
        threshold = torch.kthvalue(slot_scores, min(new_ids.numel(), size)).values
        candidates = (slot_scores <= threshold).nonzero().squeeze(1)
        scores = torch.cat([slot_scores[candidates], policy.eviction_scores(current_iter, new_meta)])
        ranked = torch.argsort(scores, descending=True, stable=True)
        stay = candidates.numel()  # the candidates keep this many slots between them and the window
        kept, dropped = ranked[:stay], ranked[stay:]
        chosen = kept[kept >= stay] - stay  # window ids that get a slot, best first
        evicted = candidates[dropped[dropped < stay]]  # entries that lose theirs, best first
        if evicted.numel() == 0:
            return
        self._evicted.append(mapping[evicted].clone())
        fresh = {m: new_meta[m][chosen] for m in slot_meta}
        _replace_entries(sorted_ids, mapping, slot_meta, evicted, new_ids[chosen], fresh)

    def evict(self) -> Optional[torch.Tensor]:
        if not self._evicted:
            return None
        slots = torch.unique(torch.cat(self._evicted))
        self._evicted = []
        return slots

    def open_slots(self) -> torch.Tensor:
        empty = (self._mch_sorted_raw_ids == EMPTY_SLOT_ID).sum().reshape(1)
        return empty - self._buckets

    def rebuild_with_output_id_range(
        self,
        output_id_range: Tuple[int, int],
        output_segments: Optional[List[int]] = None,
        device: Optional[torch.device] = None,
    ) -> MCHManagedCollisionModule:
        """A fresh module for the slots ``[start, end)`` of this one (whole buckets), for a row shard:
        it takes the ids of those buckets and returns their (global) slots."""
        start, end = output_id_range
        size = self._bucket_size
        if start % size or end % size or not 0 <= start < end <= self._zch_size:
            raise ValueError(
                f"{self._label}: rows [{start}, {end}) are not whole buckets of {size} slots "
                f"(zch_size {self._zch_size}, {self._buckets} buckets)"
            )
        return type(self)(
            end - start,
            device or self.device,
            self._eviction_policy,
            self._eviction_interval,
            self._input_hash_size,
            self._input_hash_func,
            name=self._name,
            output_global_offset=self._output_global_offset + start,
            buckets=(end - start) // size,
            _first_bucket=self._first_bucket + start // size,
            _total_buckets=self._total_buckets,
        )

    def with_buckets(self, buckets: int) -> MCHManagedCollisionModule:
        """The same configuration cut into ``buckets`` buckets; only for a module that never profiled."""
        if int(self._current_iter_tensor) != 0 or bool((self._mch_sorted_raw_ids != EMPTY_SLOT_ID).any()):
            raise ValueError(f"{self._label}: a module with state cannot be re-cut into {buckets} buckets")
        return type(self)(
            self._zch_size,
            self.device,
            self._eviction_policy,
            self._eviction_interval,
            self._input_hash_size,
            self._input_hash_func,
            name=self._name,
            output_global_offset=self._output_global_offset,
            buckets=buckets,
        )


def _replace_entries(sorted_ids, mapping, slot_meta, evicted, ids, meta) -> None:
    """Give the slots of the bucket's entries ``evicted`` to ``ids`` (with metadata ``meta``), keeping
    the bucket sorted: the other entries keep their order and the new ones are merged in, which is what
    a stable sort of the bucket gives (ids are distinct; the empty slots' sentinels keep their order)."""
    slots = mapping[evicted]
    stay = torch.ones_like(sorted_ids, dtype=torch.bool)
    stay[evicted] = False
    columns = [(sorted_ids, ids), (mapping, slots), *((slot_meta[m], meta[m]) for m in slot_meta)]
    remaining = [column[stay] for column, _ in columns]
    order = torch.argsort(ids)
    at = torch.searchsorted(remaining[0], ids[order]) + torch.arange(ids.numel(), device=ids.device)
    fill = torch.ones_like(stay)
    fill[at] = False
    for (column, fresh), rest in zip(columns, remaining):
        column[fill] = rest
        column[at] = fresh[order]


def _with_values(jt: JaggedTensor, values: torch.Tensor) -> JaggedTensor:
    return JaggedTensor(values, jt.weights_or_none(), lengths=jt.lengths(), validate=False)


# torchrec's ``torchrec.modules.mc_modules`` holds the eviction policies (re-exported above from
# mc_eviction.py) and the collection, whose file imports this one, so it is read on first use
# (docs/names.md, "torchrec's module tree").
def __getattr__(name: str):
    if name == "ManagedCollisionCollection":
        from shardkit.modules.mc_collection import ManagedCollisionCollection

        return ManagedCollisionCollection
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EMPTY_SLOT_ID",
    "DistanceLFU_EvictionPolicy",
    "LFU_EvictionPolicy",
    "LRU_EvictionPolicy",
    "MCHEvictionPolicy",
    "MCHEvictionPolicyMetadataInfo",
    "MCHManagedCollisionModule",
    "ManagedCollisionModule",
    "average_threshold_filter",
    "dynamic_threshold_filter",
]
