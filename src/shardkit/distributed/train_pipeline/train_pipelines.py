"""torchrec's ``torchrec.distributed.train_pipeline.train_pipelines`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.pipeline.pipelines import (
    PrefetchTrainPipelineSparseDist,
    TrainPipeline,
    TrainPipelineBase,
    TrainPipelineSparseDist,
)

__all__ = ["PrefetchTrainPipelineSparseDist", "TrainPipeline", "TrainPipelineBase", "TrainPipelineSparseDist"]
