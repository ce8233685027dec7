"""Optimizers the torchrec way (``torchrec.optim``): keyed and combined optimizers, row-wise Adagrad,
optimizers applied in backward and the filter that leaves their parameters out of the dense one,
learning-rate warm-up.

Layer L1: imports torch and ``shardkit.modules``. See docs/model_parallel.md ("Optimizers").
"""

from shardkit.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from shardkit.optim.clipping import GradientClipping, GradientClippingOptimizer
from shardkit.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from shardkit.optim.keyed_optimizer import KeyedOptimizer, OptimizerWrapper
from shardkit.optim.optimizers import in_backward_optimizer_filter
from shardkit.optim.rowwise_adagrad import RowWiseAdagrad
from shardkit.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

__all__ = [
    "CombinedOptimizer",
    "GradientClipping",
    "GradientClippingOptimizer",
    "KeyedOptimizer",
    "KeyedOptimizerWrapper",
    "OptimizerWrapper",
    "RowWiseAdagrad",
    "WarmupOptimizer",
    "WarmupPolicy",
    "WarmupStage",
    "apply_optimizer_in_backward",
    "in_backward_optimizer_filter",
]
