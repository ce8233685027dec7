"""torchrec's ``torchrec.modules.feature_processor_``: per-feature processors and their collections.

A ``FeatureProcessor`` turns one feature's JaggedTensor into a weighted one; a
``FeatureProcessorsCollection`` does it for a whole KeyedJaggedTensor. Both are what
``FeatureProcessedEmbeddingBagCollection`` takes. The dict-based processors of
``torchrec.modules.feature_processor`` are in ``shardkit.modules.feature_processor``.
"""

from __future__ import annotations

import abc
from typing import Dict, Mapping, Optional

import torch
from torch import nn

from shardkit.distributed.validation import host_checks_enabled
from shardkit.kernels import bag_of_each_id
from shardkit.sparse import JaggedTensor, KeyedJaggedTensor


def positions_in_bags(offsets: torch.Tensor, num_ids: int) -> torch.Tensor:
    """int64 ``[num_ids]``: each id's position in its bag (fbgemm's ``offsets_range``); no host sync."""
    offsets = offsets.to(torch.int64)
    return torch.arange(num_ids, device=offsets.device) - offsets.index_select(
        0, bag_of_each_id(offsets, num_ids)
    )


def check_bag_lengths(owner: str, feature: Optional[str], lengths: torch.Tensor, max_length: int) -> None:
    """ValueError if a bag of ``feature`` is longer than ``max_length`` (a host sync; skipped when
    validation is off, and then a too-long bag makes the weight gather fail)."""
    if host_checks_enabled() and lengths.numel():
        longest = int(lengths.max())
        if longest > max_length:
            which = "" if feature is None else f" of feature {feature!r}"
            raise ValueError(
                f"{owner}: a bag{which} has {longest} ids, more than max_feature_length {max_length}"
            )


class FeatureProcessor(nn.Module, abc.ABC):
    """Maps a feature's ``JaggedTensor`` to one with the same values and lengths and new weights."""

    @abc.abstractmethod
    def forward(self, features: JaggedTensor) -> JaggedTensor: ...

    @abc.abstractmethod
    def reset_parameters(self) -> None:
        """(Re)initialize the parameters, e.g. after meta-device construction and ``to_empty``."""


class PositionWeightedModule(FeatureProcessor):
    """Weights each id by a learned weight of its position in its bag.

    ``position_weight`` ``[max_feature_length]`` (init 1.0); the id at position p of a bag gets weight
    ``position_weight[p]``, replacing any weight the input had. A bag longer than
    ``max_feature_length`` raises ValueError (a host sync, skipped when validation is off; then the
    gather itself fails on CPU).
    """

    def __init__(
        self,
        max_feature_length: int,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        if max_feature_length <= 0:
            raise ValueError(f"max_feature_length must be positive, got {max_feature_length}")
        self.max_feature_length = max_feature_length
        self.position_weight = nn.Parameter(torch.empty(max_feature_length, dtype=dtype, device=device))
        if self.position_weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.position_weight.fill_(1.0)

    def forward(self, features: JaggedTensor) -> JaggedTensor:
        """values ``[N]`` ids, lengths ``[B]`` -> same values and lengths, weights ``[N]`` of ``dtype``."""
        check_bag_lengths("PositionWeightedModule", None, features.lengths(), self.max_feature_length)
        positions = positions_in_bags(features.offsets(), features.values().size(0))
        return JaggedTensor(
            features.values(),
            self.position_weight.index_select(0, positions),
            lengths=features.lengths(),
            offsets=features.offsets(),
            validate=False,
        )


class FeatureProcessorsCollection(nn.Module, abc.ABC):
    """Maps a KeyedJaggedTensor to one with the same keys, values and lengths and new weights."""

    @abc.abstractmethod
    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor: ...


def with_weights(features: KeyedJaggedTensor, weights: torch.Tensor) -> KeyedJaggedTensor:
    """``features`` with ``weights`` ``[N]`` as its weights (every other tensor and cache shared)."""
    variable = features.variable_stride_per_key()
    return KeyedJaggedTensor(
        features.keys(),
        features.values(),
        weights,
        lengths=features.lengths(),
        stride=None if variable else features.stride(),
        stride_per_key_per_rank=features.stride_per_key_per_rank() if variable else None,
        offset_per_key=features.offset_per_key(),
        inverse_indices=features.inverse_indices_or_none(),
        validate=False,
    )


class PositionWeightedModuleCollection(FeatureProcessorsCollection):
    """Position weights of several features in one module (torchrec's ``PositionWeightedModuleCollection``).

    ``position_weights[f]`` ``[max_feature_lengths[f]]`` (init 1.0). forward(kjt) -> the same KJT with
    weights ``[N]`` float: a feature of the collection weighs its id at position p by
    ``position_weights[f][p]``; any other feature gets weight 1 (the input's weights are replaced).
    """

    def __init__(self, max_feature_lengths: Dict[str, int], device: Optional[torch.device] = None) -> None:
        super().__init__()
        bad = {f: n for f, n in max_feature_lengths.items() if n <= 0}
        if bad:
            raise ValueError(
                f"PositionWeightedModuleCollection: max_feature_lengths must be positive, got {bad}"
            )
        self.max_feature_lengths = dict(max_feature_lengths)
        self.position_weights = nn.ParameterDict(
            {f: nn.Parameter(torch.empty(n, device=device)) for f, n in self.max_feature_lengths.items()}
        )
        if device is None or torch.device(device).type != "meta":
            self.reset_parameters()

    @property
    def position_weights_dict(self) -> Dict[str, nn.Parameter]:
        return dict(self.position_weights.items())

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for weight in self.position_weights.values():
                weight.fill_(1.0)

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        positions = positions_in_bags(features.offsets(), features.values().size(0))
        lengths = features.lengths().split(features.stride_per_key())
        pieces = []
        for key, seq, bag_lengths in zip(
            features.keys(), positions.split(features.length_per_key()), lengths
        ):
            if key in self.position_weights:
                check_bag_lengths(type(self).__name__, key, bag_lengths, self.max_feature_lengths[key])
                pieces.append(self.position_weights[key].index_select(0, seq))
            else:
                pieces.append(torch.ones(seq.numel(), device=seq.device))
        weights = torch.cat(pieces) if pieces else features.values().new_zeros(0, dtype=torch.float32)
        return with_weights(features, weights)


class FeatureProcessorDictWrapper(FeatureProcessorsCollection):
    """A ``{feature: FeatureProcessor}`` dict as a collection (what ``FeatureProcessedEmbeddingBagCollection
    .split()`` returns for one): processed features get their processor's weights, the others keep
    the input's (1 without)."""

    def __init__(self, feature_processors: Mapping[str, FeatureProcessor]) -> None:
        super().__init__()
        self._feature_processors = (
            feature_processors
            if isinstance(feature_processors, nn.ModuleDict)
            else nn.ModuleDict(feature_processors)
        )

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        counts = features.length_per_key()
        original = features.weights_or_none()
        inputs = original.split(counts) if original is not None else [None] * len(counts)
        jt_dict = features.to_dict()
        pieces = []
        for key, count, piece in zip(features.keys(), counts, inputs):
            if key in self._feature_processors:
                piece = self._feature_processors[key](jt_dict[key]).weights()
            elif piece is None:
                piece = torch.ones(count, device=features.values().device)
            pieces.append(piece)
        weights = torch.cat(pieces) if pieces else features.values().new_zeros(0, dtype=torch.float32)
        return with_weights(features, weights)
