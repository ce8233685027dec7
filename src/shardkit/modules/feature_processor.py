"""torchrec's ``torchrec.modules.feature_processor``: position weights over a dict of features
(``PositionWeightedModule``) or a KeyedJaggedTensor (``PositionWeightedProcessor``).

The per-feature processors that ``FeatureProcessedEmbeddingBagCollection`` takes
(``FeatureProcessor``, the one-feature ``PositionWeightedModule``) are in
``shardkit.modules.feature_processor_``, as in torchrec.
"""

from __future__ import annotations

import abc
from typing import Dict, Optional

import torch
from torch import nn

from shardkit.modules.feature_processor_ import check_bag_lengths, positions_in_bags, with_weights
from shardkit.sparse import JaggedTensor, KeyedJaggedTensor


def _position_weights(owner: str, max_feature_lengths: Dict[str, int], device) -> nn.ParameterDict:
    bad = {f: n for f, n in max_feature_lengths.items() if n <= 0}
    if bad:
        raise ValueError(f"{owner}: max_feature_lengths must be positive, got {bad}")
    weights = nn.ParameterDict(
        {f: nn.Parameter(torch.empty(n, device=device)) for f, n in max_feature_lengths.items()}
    )
    if device is None or torch.device(device).type != "meta":
        with torch.no_grad():
            for weight in weights.values():
                weight.fill_(1.0)
    return weights


def _weighted(owner: str, key: str, jt: JaggedTensor, table: torch.Tensor, max_length: int) -> JaggedTensor:
    check_bag_lengths(owner, key, jt.lengths(), max_length)
    positions = positions_in_bags(jt.offsets(), jt.values().size(0))
    return JaggedTensor(
        jt.values(),
        table.index_select(0, positions),
        lengths=jt.lengths(),
        offsets=jt.offsets(),
        validate=False,
    )


class BaseFeatureProcessor(nn.Module, abc.ABC):
    """Maps ``{feature: JaggedTensor}`` to ``{feature: JaggedTensor}``."""

    @abc.abstractmethod
    def forward(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]: ...


class PositionWeightedModule(BaseFeatureProcessor):
    """Position weights for the features of ``max_feature_lengths`` (feature -> longest bag).

    ``position_weights[f]`` ``[max_feature_lengths[f]]`` (init 1.0). forward(dict) -> the same dict
    (updated in place, as torchrec) where each feature of ``max_feature_lengths`` has weights: the id
    at position p of a bag gets ``position_weights[f][p]``. Other features pass through unchanged.
    """

    def __init__(self, max_feature_lengths: Dict[str, int], device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.max_feature_lengths = dict(max_feature_lengths)
        self.position_weights = _position_weights(type(self).__name__, self.max_feature_lengths, device)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for weight in self.position_weights.values():
                weight.fill_(1.0)

    def forward(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        missing = [f for f in self.position_weights if f not in features]
        if missing:
            raise KeyError(
                f"PositionWeightedModule: input lacks feature(s) {missing}; it has {list(features)}"
            )
        for key, table in self.position_weights.items():
            features[key] = _weighted(
                type(self).__name__, key, features[key], table, self.max_feature_lengths[key]
            )
        return features


class BaseGroupedFeatureProcessor(nn.Module, abc.ABC):
    """Maps a KeyedJaggedTensor to a KeyedJaggedTensor."""

    @abc.abstractmethod
    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor: ...


class PositionWeightedProcessor(BaseGroupedFeatureProcessor):
    """Position weights over a KeyedJaggedTensor (torchrec's ``PositionWeightedProcessor``).

    forward(kjt) -> a KJT of the processed features only, in the input's order, each weighted by its
    ``position_weights[f][position]`` (as torchrec, which drops the features it does not process
    when the input mixes both). ``position_weights[f]`` ``[max_feature_lengths[f]]``, init 1.0.
    """

    def __init__(self, max_feature_lengths: Dict[str, int], device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.max_feature_lengths = dict(max_feature_lengths)
        self.position_weights = _position_weights(type(self).__name__, self.max_feature_lengths, device)

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        keys = features.keys()
        processed = [i for i, k in enumerate(keys) if k in self.position_weights]
        if len(processed) < len(keys):
            features = features.permute(processed)
        positions = positions_in_bags(features.offsets(), features.values().size(0))
        lengths = features.lengths().split(features.stride_per_key())
        pieces = []
        for key, seq, bag_lengths in zip(
            features.keys(), positions.split(features.length_per_key()), lengths
        ):
            check_bag_lengths(type(self).__name__, key, bag_lengths, self.max_feature_lengths[key])
            pieces.append(self.position_weights[key].index_select(0, seq))
        weights = torch.cat(pieces) if pieces else torch.zeros(0, device=features.values().device)
        return with_weights(features, weights)
