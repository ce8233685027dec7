"""Feature processors: modules that turn one feature's JaggedTensor into a weighted one."""

from __future__ import annotations

import abc
from typing import Optional

import torch
from torch import nn

from shardkit.distributed.validation import validation_enabled
from shardkit.kernels import bag_of_each_id
from shardkit.sparse import JaggedTensor


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
        offsets = features.offsets().to(torch.int64)
        num_ids = features.values().size(0)
        if validation_enabled() and offsets.numel() > 1:
            longest = int(offsets.diff().max())
            if longest > self.max_feature_length:
                raise ValueError(
                    f"PositionWeightedModule: a bag has {longest} ids, more than max_feature_length "
                    f"{self.max_feature_length}"
                )
        bag = bag_of_each_id(offsets, num_ids)
        positions = torch.arange(num_ids, device=offsets.device) - offsets.index_select(0, bag)
        return JaggedTensor(
            features.values(),
            self.position_weight.index_select(0, positions),
            lengths=features.lengths(),
            offsets=features.offsets(),
            validate=False,
        )
