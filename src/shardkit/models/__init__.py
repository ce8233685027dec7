"""Reference models (L5): torchrec's ``DLRM`` / ``DLRMTrain`` and the demo's mixed-width DLRM.

See docs/models.md.
"""

from shardkit.models.dlrm import DLRM, DenseArch, DLRMTrain, InteractionArch, OverArch, SparseArch
from shardkit.models.mixed_dim_dlrm import MixedDimDLRM, dense_parameters

__all__ = [
    "DLRM",
    "DLRMTrain",
    "DenseArch",
    "InteractionArch",
    "MixedDimDLRM",
    "OverArch",
    "SparseArch",
    "dense_parameters",
]
