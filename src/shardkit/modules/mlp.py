"""torchrec's ``torchrec.modules.mlp``: ``Perceptron`` (linear + activation) and ``MLP`` (a stack of them).

Same parameter names as torchrec (``_mlp.<i>._linear.weight``), so a model built from them (the DLRM
arches) has torchrec's state-dict keys.
"""

from __future__ import annotations

import inspect
from typing import Callable, List, Optional, Union

import torch
from torch import nn

from shardkit.modules.activation import SwishLayerNorm

Activation = Union[str, nn.Module, Callable[[], nn.Module], Callable[[torch.Tensor], torch.Tensor]]
_NAMED = {"relu": torch.relu, "sigmoid": torch.sigmoid}


class Perceptron(nn.Module):
    """``activation(linear(x))``: ``[..., in_size]`` -> ``[..., out_size]``."""

    def __init__(
        self,
        in_size: int,
        out_size: int,
        bias: bool = True,
        activation: Union[nn.Module, Callable[[torch.Tensor], torch.Tensor]] = torch.relu,
        device: Optional[torch.device] = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self._in_size, self._out_size = in_size, out_size
        self._linear = nn.Linear(in_size, out_size, bias=bias, device=device, dtype=dtype)
        self._activation_fn = activation

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._activation_fn(self._linear(input))


def _activation_for_layer(activation: Activation):
    """A module factory (a callable taking no argument, e.g. ``nn.ReLU``) makes one module per layer;
    a module or a tensor function (``torch.relu``) is used as is."""
    if isinstance(activation, nn.Module) or not callable(activation):
        return activation
    try:
        parameters = inspect.signature(activation).parameters.values()
    except (TypeError, ValueError):  # a builtin such as torch.relu: a tensor function
        return activation
    if any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return activation
    made = activation()
    if not isinstance(made, nn.Module):
        raise ValueError(f"MLP: an activation taking no argument must return an nn.Module, got {type(made)}")
    return made


class MLP(nn.Module):
    """``len(layer_sizes)`` perceptrons: ``[..., in_size]`` -> ``[..., layer_sizes[-1]]``.

    ``activation``: ``"relu"`` / ``"sigmoid"``, ``"swish_layernorm"`` (a ``SwishLayerNorm`` of each
    layer's width, as torchrec), a tensor function, a module, or a module factory (one module per
    layer); ``activation_on_last=False`` leaves the last layer linear.
    """

    def __init__(
        self,
        in_size: int,
        layer_sizes: List[int],
        bias: bool = True,
        activation: Activation = torch.relu,
        device: Optional[torch.device] = None,
        dtype: torch.dtype = torch.float32,
        activation_on_last: bool = True,
    ) -> None:
        super().__init__()
        sizes = [in_size, *layer_sizes]
        if isinstance(activation, str) and activation not in (*_NAMED, "swish_layernorm"):
            raise ValueError(
                f"MLP: activation {activation!r} is not supported; use one of {[*_NAMED, 'swish_layernorm']}"
            )

        def layer_activation(width: int):
            if activation == "swish_layernorm":  # normalizes the layer's own output width
                return SwishLayerNorm(width, device=device)
            return _activation_for_layer(
                _NAMED.get(activation, activation) if isinstance(activation, str) else activation
            )

        activations = [layer_activation(width) for width in layer_sizes]
        self._mlp = nn.Sequential(
            *[
                Perceptron(
                    sizes[i],
                    sizes[i + 1],
                    bias=bias,
                    activation=nn.Identity()
                    if not activation_on_last and i == len(layer_sizes) - 1
                    else activations[i],
                    device=device,
                    dtype=dtype,
                )
                for i in range(len(layer_sizes))
            ]
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._mlp(input)
