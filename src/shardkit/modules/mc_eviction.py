"""Eviction policies of :class:`~shardkit.modules.MCHManagedCollisionModule`: which ids keep a slot.

At an eviction step a bucket of ``S`` slots has ``S`` candidates already in it (ids, empty slots and
the reserved miss slot) and the ids seen since the last eviction that it does not hold yet. Every
candidate gets a score from its metadata; the ``S`` best stay (see docs/managed_collision.md for the
exact order and tie breaking). A policy only says which metadata it keeps and how it scores:

- ``counts``: how many times an id was seen (while it held a slot, plus the window it came in with);
- ``last_access_iter``: the last iteration (``profile`` call) the id was seen in.

Scores are float64 (exact for counts below 2**53); higher stays.
"""

from __future__ import annotations

import abc
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

ThresholdFilter = Callable[[torch.Tensor], Tuple[torch.Tensor, Union[float, torch.Tensor]]]


class MCHEvictionPolicyMetadataInfo(NamedTuple):
    """One metadata counter of a policy: kept per slot (``is_mch_metadata``) and/or per id of the
    history window (``is_history_metadata``)."""

    metadata_name: str
    is_mch_metadata: bool
    is_history_metadata: bool


_COUNTS = MCHEvictionPolicyMetadataInfo("counts", True, False)
_LAST_ACCESS = MCHEvictionPolicyMetadataInfo("last_access_iter", True, True)


class MCHEvictionPolicy(abc.ABC):
    """What an eviction policy provides.

    Args:
        metadata_info: the counters this policy keeps per slot (int64 buffers ``_mch_<name>``).
        threshold_filtering_func: ``f(counts [U] int64) -> (mask [U] bool, threshold)``: ids of the
            window whose mask is False are ignored at this eviction (neither inserted nor counted).
    """

    def __init__(
        self,
        metadata_info: List[MCHEvictionPolicyMetadataInfo],
        threshold_filtering_func: Optional[ThresholdFilter] = None,
    ) -> None:
        self._metadata_info = metadata_info
        self._threshold_filtering_func = threshold_filtering_func

    @property
    def metadata_info(self) -> List[MCHEvictionPolicyMetadataInfo]:
        return self._metadata_info

    @property
    def metadata_names(self) -> List[str]:
        return [m.metadata_name for m in self._metadata_info if m.is_mch_metadata]

    @property
    def threshold_filtering_func(self) -> Optional[ThresholdFilter]:
        return self._threshold_filtering_func

    @abc.abstractmethod
    def eviction_scores(self, current_iter: int, metadata: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Score ``[N]`` float64 of candidates with ``metadata`` (``{name: [N] int64}``); higher stays."""

    def config(self) -> tuple:
        """What ranks compare to agree on the policy (type and parameters, not the filter's identity)."""
        decay = getattr(self, "_decay_exponent", None)
        return (type(self).__name__, decay, self._threshold_filtering_func is None)


def _distance(current_iter: int, last_access: torch.Tensor, decay_exponent: float) -> torch.Tensor:
    return (current_iter - last_access + 1).to(torch.float64).pow(decay_exponent)


class LFU_EvictionPolicy(MCHEvictionPolicy):  # noqa: N801 (the specification's name)
    """Least frequently used: score = count. Counts of ids in the map accumulate forever."""

    def __init__(self, threshold_filtering_func: Optional[ThresholdFilter] = None) -> None:
        super().__init__([_COUNTS], threshold_filtering_func)

    def eviction_scores(self, current_iter: int, metadata: Dict[str, torch.Tensor]) -> torch.Tensor:
        return metadata["counts"].to(torch.float64)


class LRU_EvictionPolicy(MCHEvictionPolicy):  # noqa: N801
    """Least recently used: score = ``-(current_iter - last_access_iter + 1) ** decay_exponent``."""

    def __init__(
        self, decay_exponent: float = 1.0, threshold_filtering_func: Optional[ThresholdFilter] = None
    ) -> None:
        super().__init__([_LAST_ACCESS], threshold_filtering_func)
        self._decay_exponent = decay_exponent

    def eviction_scores(self, current_iter: int, metadata: Dict[str, torch.Tensor]) -> torch.Tensor:
        return -_distance(current_iter, metadata["last_access_iter"], self._decay_exponent)


class DistanceLFU_EvictionPolicy(MCHEvictionPolicy):  # noqa: N801
    """Frequency over recency: score = ``count / (current_iter - last_access_iter + 1) ** decay_exponent``."""

    def __init__(
        self, decay_exponent: float = 1.0, threshold_filtering_func: Optional[ThresholdFilter] = None
    ) -> None:
        super().__init__([_COUNTS, _LAST_ACCESS], threshold_filtering_func)
        self._decay_exponent = decay_exponent

    def eviction_scores(self, current_iter: int, metadata: Dict[str, torch.Tensor]) -> torch.Tensor:
        counts = metadata["counts"].to(torch.float64)
        return counts / _distance(current_iter, metadata["last_access_iter"], self._decay_exponent)


@torch.no_grad()
def dynamic_threshold_filter(
    id_counts: torch.Tensor, threshold_skew_multiplier: float = 10.0
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keep ids seen more than ``threshold_skew_multiplier`` times the mean count."""
    threshold = id_counts.sum().to(torch.float64) / max(id_counts.numel(), 1) * threshold_skew_multiplier
    return id_counts > threshold, threshold


@torch.no_grad()
def average_threshold_filter(id_counts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keep ids seen more often than the mean count."""
    threshold = id_counts.to(torch.float64).mean()
    return id_counts > threshold, threshold


__all__ = [
    "DistanceLFU_EvictionPolicy",
    "LFU_EvictionPolicy",
    "LRU_EvictionPolicy",
    "MCHEvictionPolicy",
    "MCHEvictionPolicyMetadataInfo",
    "average_threshold_filter",
    "dynamic_threshold_filter",
]
