"""torchrec's ``torchrec.distributed.train_pipeline`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.distributed.absent_names import absent
from shardkit.pipeline.context import PrefetchTrainPipelineContext, TrainPipelineContext
from shardkit.pipeline.forwards import BaseForward, PipelinedForward, PrefetchPipelinedForward
from shardkit.pipeline.pipelines import (
    PrefetchTrainPipelineSparseDist,
    TrainPipeline,
    TrainPipelineBase,
    TrainPipelineSparseDist,
)
from shardkit.pipeline.tracing import ArgInfo, Tracer

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
]

# torchrec's names here that shardkit lacks: importing one is an ImportError naming it
__getattr__ = absent(
    __name__,
    ["FusedKJTListSplitsAwaitable", "KJTAllToAllForward", "KJTSplitsAllToAllMeta", "SplitsAllToAllAwaitable"],
)
