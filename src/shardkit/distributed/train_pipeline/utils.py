"""torchrec's ``torchrec.distributed.train_pipeline.utils`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.pipeline.context import PrefetchTrainPipelineContext, TrainPipelineContext
from shardkit.pipeline.forwards import BaseForward, PipelinedForward, PrefetchPipelinedForward
from shardkit.pipeline.tracing import ArgInfo, Tracer

__all__ = [
    "ArgInfo",
    "BaseForward",
    "PipelinedForward",
    "PrefetchPipelinedForward",
    "PrefetchTrainPipelineContext",
    "Tracer",
    "TrainPipelineContext",
]
