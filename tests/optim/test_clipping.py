"""GradientClippingOptimizer: total-norm or element-wise clipping of the gradients, then the step."""

import pytest
import torch

from shardkit.optim import GradientClipping, GradientClippingOptimizer, KeyedOptimizerWrapper


def _sgd(*grads):
    params = {f"p{i}": torch.nn.Parameter(torch.zeros(len(g))) for i, g in enumerate(grads)}
    for p, g in zip(params.values(), grads):
        p.grad = torch.tensor(g)
    return params, KeyedOptimizerWrapper(params, lambda ps: torch.optim.SGD(ps, lr=1.0))


def test_norm_clipping_scales_all_gradients_by_their_total_norm_then_steps():
    params, opt = _sgd([3.0, 0.0], [0.0, 4.0])  # total 2-norm 5
    GradientClippingOptimizer(opt, GradientClipping.NORM, max_gradient=1.0).step()
    assert torch.allclose(params["p0"].grad, torch.tensor([0.6, 0.0]))
    assert torch.allclose(params["p1"].grad, torch.tensor([0.0, 0.8]))
    assert torch.allclose(params["p1"], torch.tensor([0.0, -0.8]))  # SGD stepped on the clipped grad
    params, opt = _sgd([3.0, -4.0])
    GradientClippingOptimizer(opt, GradientClipping.NORM, max_gradient=2.0, norm_type="inf").step()
    assert torch.allclose(params["p0"].grad, torch.tensor([1.5, -2.0]))  # inf-norm 4 -> 2


def test_value_clipping_clamps_each_element_and_none_leaves_them():
    params, opt = _sgd([3.0, -0.5, -7.0])
    GradientClippingOptimizer(opt, GradientClipping.VALUE, max_gradient=1.0).step()
    assert params["p0"].grad.tolist() == [1.0, -0.5, -1.0]
    params, opt = _sgd([3.0])
    GradientClippingOptimizer(opt).step()  # NONE by default
    assert params["p0"].grad.tolist() == [3.0]


def test_meta_parameters_are_not_clipped(monkeypatch):
    p = torch.nn.Parameter(torch.zeros(2, device="meta"))
    p.grad = torch.ones(2, device="meta")
    opt = KeyedOptimizerWrapper({"p": p}, lambda ps: torch.optim.SGD(ps, lr=1.0))
    called = []
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: called.append(a))
    GradientClippingOptimizer(opt, GradientClipping.NORM, max_gradient=1.0).step()
    assert called == []


def test_global_clipping_over_process_groups_is_refused():
    _, opt = _sgd([1.0])
    with pytest.raises(ValueError, match="enable_global_grad_clip"):
        GradientClippingOptimizer(opt, GradientClipping.NORM, enable_global_grad_clip=True)
