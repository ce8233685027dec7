"""Moved: the demo's model is ``shardkit.models.MixedDimDLRM``, its batch ``shardkit.datasets.Batch``.

This module keeps the old import path working.
"""

from shardkit.datasets import Batch, TableSpec, concat_batches
from shardkit.models.mixed_dim_dlrm import MixedDimDLRM as DLRM
from shardkit.models.mixed_dim_dlrm import dense_parameters

__all__ = ["DLRM", "Batch", "TableSpec", "concat_batches", "dense_parameters"]
