"""Layer 5: train pipelines that overlap the sharded modules' communication with compute.

``TrainPipelineSparseDist(model, optimizer, device).progress(iter(dataloader))`` trains on one batch
while the input dists of the next one are under way; ``PrefetchTrainPipelineSparseDist`` completes
them a step ahead; ``TrainPipelineBase`` only fetches the next batch ahead. See docs/pipeline.md.
"""

from shardkit.pipeline.context import PrefetchTrainPipelineContext, TrainPipelineContext
from shardkit.pipeline.forwards import BaseForward, PipelinedForward, PrefetchPipelinedForward
from shardkit.pipeline.pipelines import (
    PrefetchTrainPipelineSparseDist,
    TrainPipeline,
    TrainPipelineBase,
    TrainPipelineSparseDist,
)
from shardkit.pipeline.tracing import ArgInfo, Tracer, build_args, find_pipelineable_modules

__all__ = [
    "ArgInfo",
    "BaseForward",
    "PipelinedForward",
    "PrefetchPipelinedForward",
    "PrefetchTrainPipelineContext",
    "PrefetchTrainPipelineSparseDist",
    "Tracer",
    "TrainPipeline",
    "TrainPipelineBase",
    "TrainPipelineContext",
    "TrainPipelineSparseDist",
    "build_args",
    "find_pipelineable_modules",
]
