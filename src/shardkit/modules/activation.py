"""torchrec's ``torchrec.modules.activation``: ``SwishLayerNorm``, the ``"swish_layernorm"`` of ``MLP``."""

from __future__ import annotations

from typing import List, Optional, Union

import torch
from torch import nn


class SwishLayerNorm(nn.Module):
    """``x * sigmoid(layer_norm(x))`` over the last ``len(input_dims)`` dims: ``[..., *input_dims]`` in
    and out, the input's dtype.

    ``input_dims``: an int or a shape, as ``nn.LayerNorm``'s ``normalized_shape``. The parameters are
    the layer norm's affine weight and bias, at torchrec's names (``norm.0.weight``, ``norm.0.bias``).
    """

    def __init__(
        self, input_dims: Union[int, List[int], torch.Size], device: Optional[torch.device] = None
    ) -> None:
        super().__init__()
        self.norm = nn.Sequential(nn.LayerNorm(input_dims, device=device), nn.Sigmoid())

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input * self.norm(input)


__all__ = ["SwishLayerNorm"]
