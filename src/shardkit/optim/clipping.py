"""torchrec's ``GradientClippingOptimizer`` (``torchrec.optim.clipping``): clip the gradients of a keyed
optimizer's parameters, by their total norm or element-wise, before it steps.
"""

from __future__ import annotations

import enum
from typing import Any, Dict, List, Optional, Union

import torch

from shardkit.optim.keyed_optimizer import KeyedOptimizer, OptimizerWrapper


class GradientClipping(enum.Enum):
    """``NORM``: scale all gradients so their total ``norm_type`` norm is at most ``max_gradient``;
    ``VALUE``: clamp each gradient element to ``[-max_gradient, max_gradient]``; ``NONE``: no clipping."""

    NORM = "norm"
    VALUE = "value"
    NONE = "none"


class GradientClippingOptimizer(OptimizerWrapper):
    """Clips the gradients of ``optimizer``'s parameters, then steps it.

    Args:
        optimizer: the ``KeyedOptimizer`` to wrap (e.g. a ``KeyedOptimizerWrapper``).
        clipping: a ``GradientClipping``.
        max_gradient: the largest total norm (NORM) or absolute element value (VALUE).
        norm_type: the norm of NORM clipping (``2.0``, ``1``, ``"inf"``, ...), as torch's
            ``clip_grad_norm_``.
        enable_global_grad_clip, param_to_pgs: torchrec's norm over parameters sharded across process
            groups; not supported here (``ValueError``): shardkit's sharded tables are trained by fused
            optimizers and have no gradients to clip.

    Parameters on the meta device, and parameters without a gradient, are left out of the clipping.
    """

    def __init__(
        self,
        optimizer: KeyedOptimizer,
        clipping: GradientClipping = GradientClipping.NONE,
        max_gradient: float = 0.1,
        norm_type: Union[float, str] = 2.0,
        enable_global_grad_clip: bool = False,
        param_to_pgs: Optional[Dict[Any, Any]] = None,
    ) -> None:
        super().__init__(optimizer)
        if enable_global_grad_clip or param_to_pgs:
            raise ValueError(
                "GradientClippingOptimizer: enable_global_grad_clip / param_to_pgs are not supported; "
                "clip the dense parameters' gradients (sharded tables are trained by fused optimizers)"
            )
        self._clipping = GradientClipping(clipping)
        self._max_gradient = max_gradient
        self._norm_type = float(norm_type) if isinstance(norm_type, str) else norm_type

    def _clippable(self) -> List[torch.Tensor]:
        return [
            p
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None and p.device.type != "meta"
        ]

    def step(self, closure: Any = None) -> Any:
        params = self._clippable() if self._clipping is not GradientClipping.NONE else []
        if params and self._clipping is GradientClipping.NORM:
            torch.nn.utils.clip_grad_norm_(params, self._max_gradient, norm_type=self._norm_type)
        elif params and self._clipping is GradientClipping.VALUE:
            torch.nn.utils.clip_grad_value_(params, self._max_gradient)
        return super().step(closure)
