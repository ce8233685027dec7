"""What a train pipeline keeps per batch between starting its input dists and running its forward.

Each batch in flight has its own context, so the input dists of batch i+1 never overwrite what the
forward of batch i consumes. Keys are the sharded modules' paths in the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

from shardkit.distributed.awaitable import Awaitable


@dataclasses.dataclass
class TrainPipelineContext:
    """Context of one batch in a ``TrainPipelineSparseDist``.

    Attributes:
        input_dist_splits_requests: the started first phase (sizes) of each module's input dist.
        input_dist_tensors_requests: the started second phase (tensors), once the sizes arrived.
        module_contexts: each module's ``create_context()`` for this batch, filled by ``input_dist``
            and read by ``compute_and_output_dist``.
    """

    input_dist_splits_requests: Dict[str, Awaitable[Any]] = dataclasses.field(default_factory=dict)
    input_dist_tensors_requests: Dict[str, Awaitable[Any]] = dataclasses.field(default_factory=dict)
    module_contexts: Dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PrefetchTrainPipelineContext(TrainPipelineContext):
    """Context of one batch in a ``PrefetchTrainPipelineSparseDist``: also the received input and the
    module contexts once the input dist completed, one step ahead of the batch's forward.

    Attributes:
        module_input_post_prefetch: each module's distributed input (what ``compute`` takes).
        module_contexts_post_prefetch: the module contexts that go with it.
    """

    module_input_post_prefetch: Dict[str, Any] = dataclasses.field(default_factory=dict)
    module_contexts_post_prefetch: Dict[str, Any] = dataclasses.field(default_factory=dict)


__all__ = ["PrefetchTrainPipelineContext", "TrainPipelineContext"]
