"""torchrec's MLP / Perceptron: layer sizes, activations (named, swish-layernorm, function, module factory),
last layer."""

import pytest
import torch
from torch import nn

from shardkit.modules.activation import SwishLayerNorm
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
    with pytest.raises(ValueError, match="'gelu' is not supported"):
        MLP(3, [2], activation="gelu")


def test_swish_layernorm_is_x_times_sigmoid_of_its_layer_norm():
    torch.manual_seed(1)
    x = torch.randn(5, 3)
    mlp = MLP(3, [4, 2], activation="swish_layernorm")
    # torchrec's parameter names: the norm of each layer at _activation_fn.norm.0
    assert [k for k in mlp.state_dict() if "_activation_fn" in k] == [
        "_mlp.0._activation_fn.norm.0.weight",
        "_mlp.0._activation_fn.norm.0.bias",
        "_mlp.1._activation_fn.norm.0.weight",
        "_mlp.1._activation_fn.norm.0.bias",
    ]
    with torch.no_grad():
        for layer in mlp._mlp:
            layer._activation_fn.norm[0].weight.uniform_(0.5, 1.5)
            layer._activation_fn.norm[0].bias.uniform_(-0.5, 0.5)
    expected = x
    for layer in mlp._mlp:
        y = layer._linear(expected)
        ln = layer._activation_fn.norm[0]
        normed = (y - y.mean(-1, keepdim=True)) / torch.sqrt(y.var(-1, unbiased=False, keepdim=True) + ln.eps)
        expected = y * torch.sigmoid(normed * ln.weight + ln.bias)
    torch.testing.assert_close(mlp(x), expected)
    assert SwishLayerNorm([2, 3])(torch.randn(4, 2, 3)).shape == (4, 2, 3)
