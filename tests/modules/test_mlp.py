"""torchrec's MLP / Perceptron: layer sizes, activations (named, function, module factory), last layer."""

import pytest
import torch
from torch import nn

from shardkit.modules.mlp import MLP, Perceptron


def test_mlp_layers_and_activations():
    torch.manual_seed(0)
    x = torch.randn(5, 3)
    mlp = MLP(3, [4, 2])
    first, second = mlp._mlp[0]._linear, mlp._mlp[1]._linear
    torch.testing.assert_close(mlp(x), torch.relu(second(torch.relu(first(x)))))
    linear_last = MLP(3, [4, 2], activation="sigmoid", activation_on_last=False)
    a, b = linear_last._mlp[0]._linear, linear_last._mlp[1]._linear
    torch.testing.assert_close(linear_last(x), b(torch.sigmoid(a(x))))
    per_layer = MLP(3, [4, 2], activation=nn.ReLU)  # a factory: one module per layer
    assert per_layer._mlp[0]._activation_fn is not per_layer._mlp[1]._activation_fn
    assert isinstance(per_layer._mlp[0]._activation_fn, nn.ReLU)
    assert Perceptron(3, 2, bias=False)._linear.bias is None
    with pytest.raises(ValueError, match="'swish_layernorm' is not supported"):
        MLP(3, [2], activation="swish_layernorm")
