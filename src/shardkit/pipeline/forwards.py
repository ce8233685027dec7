"""The forwards a pipeline installs on its sharded modules: consume the input dist it started earlier.

A pipelined module's ``forward`` is replaced by one of these objects. When the model calls the module,
the arguments are ignored (the pipeline already sent the same batch's input through ``input_dist``);
the forward takes the distributed input of the current batch from the batch's context and runs
``compute_and_output_dist``. The pipeline points the forwards at the right context before each
forward of the model.
"""

from __future__ import annotations

from typing import Any, Generic, List, TypeVar

from shardkit.distributed.awaitable import LazyAwaitable
from shardkit.pipeline.context import PrefetchTrainPipelineContext, TrainPipelineContext
from shardkit.pipeline.tracing import ArgInfo
from shardkit.sharding.types import ShardedModule

Ctx = TypeVar("Ctx", bound=TrainPipelineContext)


class BaseForward(Generic[Ctx]):
    """A pipelined module's forward: its path, how to get its input from a batch, and the context.

    Args:
        name: the module's path in the model (the context's key).
        args: how each argument is taken from the batch.
        module: the sharded module.
        context: the context of the batch whose forward comes next.

    The specification's ``stream`` argument is absent: every stage runs on the current stream (see
    docs/pipeline.md).
    """

    def __init__(self, name: str, args: List[ArgInfo], module: ShardedModule, context: Ctx) -> None:
        self._name = name
        self._args = args
        self._module = module
        self._context = context

    @property
    def name(self) -> str:
        return self._name

    @property
    def args(self) -> List[ArgInfo]:
        return self._args

    @property
    def module(self) -> ShardedModule:
        return self._module

    def set_context(self, context: Ctx) -> None:
        self._context = context

    def _missing(self) -> RuntimeError:
        return RuntimeError(
            f"pipelined forward of {self._name!r}: no input dist was started for this batch (the module "
            "may be called once per batch, and only inside the pipeline's progress; use the pipeline's "
            "detach() to run the model outside it)"
        )


class PipelinedForward(BaseForward[TrainPipelineContext]):
    """Waits the tensors phase of the batch's input dist, then computes and starts the output dist."""

    def __call__(self, *input: Any, **kwargs: Any) -> LazyAwaitable[Any]:
        if self._name not in self._context.input_dist_tensors_requests:
            raise self._missing()
        data = self._context.input_dist_tensors_requests.pop(self._name).wait()
        module_context = self._context.module_contexts.pop(self._name)
        return self._module.compute_and_output_dist(module_context, data)


class PrefetchPipelinedForward(BaseForward[PrefetchTrainPipelineContext]):
    """Takes the input the pipeline received one step early, then computes and starts the output dist."""

    def __call__(self, *input: Any, **kwargs: Any) -> LazyAwaitable[Any]:
        if self._name not in self._context.module_input_post_prefetch:
            raise self._missing()
        data = self._context.module_input_post_prefetch.pop(self._name)
        module_context = self._context.module_contexts_post_prefetch.pop(self._name)
        return self._module.compute_and_output_dist(module_context, data)


__all__ = ["BaseForward", "PipelinedForward", "PrefetchPipelinedForward"]
