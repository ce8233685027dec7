"""Click data sets (L1): the ``Batch`` type, synthetic and Criteo-format data (``torchrec.datasets``' role).

See docs/datasets.md and docs/models.md. The submodules ``criteo``, ``random`` and ``utils`` are
loaded with the package, as torchrec's are.
"""

from shardkit.datasets import criteo, random, utils  # noqa: F401
from shardkit.datasets.random import RandomRecDataset
from shardkit.datasets.raw_id_clicks import RawIdClicks
from shardkit.datasets.synthetic_clicks import SyntheticClicks
from shardkit.datasets.table_spec import TableSpec
from shardkit.datasets.utils import Batch, concat_batches

__all__ = ["Batch", "RandomRecDataset", "RawIdClicks", "SyntheticClicks", "TableSpec", "concat_batches"]
