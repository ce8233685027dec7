"""Click data sets (L5): the ``Batch`` type, synthetic and Criteo-format data (``torchrec.datasets``' role).

See docs/datasets.md.
"""

from shardkit.datasets.random import RandomRecDataset
from shardkit.datasets.raw_id_clicks import RawIdClicks
from shardkit.datasets.synthetic_clicks import SyntheticClicks
from shardkit.datasets.table_spec import TableSpec
from shardkit.datasets.utils import Batch, concat_batches

__all__ = ["Batch", "RandomRecDataset", "RawIdClicks", "SyntheticClicks", "TableSpec", "concat_batches"]
