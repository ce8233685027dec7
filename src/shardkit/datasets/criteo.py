"""``torchrec.datasets.criteo``: the Criteo click logs' constants, the TSV reader (``criteo_kaggle``,
``criteo_terabyte``, ``CriteoIterDataPipe``), the ``.npy`` preprocessing (``BinaryCriteoUtils``) and
the in-memory batch reader (``InMemoryBinaryCriteoIterDataPipe``), each in its own module.

torchrec's core data sets read TSV and ``.npy`` only; its Parquet path (NVTabular, in its scripts) has
no counterpart here.
"""

from shardkit.datasets.criteo_binary import BinaryCriteoUtils
from shardkit.datasets.criteo_in_memory import InMemoryBinaryCriteoIterDataPipe
from shardkit.datasets.criteo_tsv import (
    CAT_FEATURE_COUNT,
    COLUMN_TYPE_CASTERS,
    DAYS,
    DEFAULT_CAT_NAMES,
    DEFAULT_COLUMN_NAMES,
    DEFAULT_INT_NAMES,
    DEFAULT_LABEL_NAME,
    FREQUENCY_THRESHOLD,
    INT_FEATURE_COUNT,
    TOTAL_TRAINING_SAMPLES,
    CriteoIterDataPipe,
    Row,
    _default_row_mapper,
    criteo_kaggle,
    criteo_terabyte,
    default_row_mapper,
)
from shardkit.datasets.pipes import PATH_MANAGER_KEY

__all__ = [
    "CAT_FEATURE_COUNT",
    "COLUMN_TYPE_CASTERS",
    "DAYS",
    "DEFAULT_CAT_NAMES",
    "DEFAULT_COLUMN_NAMES",
    "DEFAULT_INT_NAMES",
    "DEFAULT_LABEL_NAME",
    "FREQUENCY_THRESHOLD",
    "INT_FEATURE_COUNT",
    "PATH_MANAGER_KEY",
    "TOTAL_TRAINING_SAMPLES",
    "BinaryCriteoUtils",
    "CriteoIterDataPipe",
    "InMemoryBinaryCriteoIterDataPipe",
    "Row",
    "_default_row_mapper",
    "criteo_kaggle",
    "criteo_terabyte",
    "default_row_mapper",
]
