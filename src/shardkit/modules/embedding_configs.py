"""Table configurations of the embedding modules: what a table is, before any storage exists.

A config names a table, its shape ``[num_embeddings, embedding_dim]``, its storage dtype, the features
that look it up (several features may share one table) and how its rows are initialized. The modules
build their parameters from a list of configs; :func:`check_table_configs` is the one place that
rejects an inconsistent list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum, unique
from typing import Callable, Dict, List, Optional, Sequence

import torch


@unique
class PoolingType(Enum):
    """How the rows of one bag (the ids of one feature in one sample) are reduced."""

    SUM = "SUM"
    MEAN = "MEAN"  # an empty bag pools to zeros, as a sum does
    NONE = "NONE"  # no pooling: one embedding per id (EmbeddingCollection)


@unique
class DataType(Enum):
    """Storage dtype of a table. Optimizer state and accumulations are fp32 whatever this is.

    INT8 / INT4 / INT2 are the serving precisions of ``shardkit.quant`` (row-wise quantized); the
    trainable modules hold such a table in fp32 until ``from_float`` quantizes it.
    """

    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    INT8 = "INT8"
    INT4 = "INT4"
    INT2 = "INT2"


_TORCH_DTYPES = {
    DataType.FP32: torch.float32,
    DataType.FP16: torch.float16,
    DataType.BF16: torch.bfloat16,
    DataType.INT8: torch.float32,
    DataType.INT4: torch.float32,
    DataType.INT2: torch.float32,
}


def data_type_to_dtype(data_type: DataType) -> torch.dtype:
    """The torch dtype a trainable module stores a table of ``data_type`` in (fp32 for INT types)."""
    return _TORCH_DTYPES[DataType(data_type)]


@dataclass
class BaseEmbeddingConfig:
    """One table: ``num_embeddings`` rows of ``embedding_dim`` values of ``data_type``.

    Rows are initialized by ``init_fn(weight)`` (in place, under no_grad) when given, otherwise uniformly
    in ``[weight_init_min, weight_init_max]``, whose defaults are ``-/+ sqrt(1 / num_embeddings)``.
    """

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: DataType = DataType.FP32
    feature_names: List[str] = field(default_factory=list)
    weight_init_max: Optional[float] = None
    weight_init_min: Optional[float] = None
    init_fn: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an embedding table config needs a non-empty name")
        if self.num_embeddings <= 0 or self.embedding_dim <= 0:
            raise ValueError(
                f"table '{self.name}': num_embeddings and embedding_dim must be positive, "
                f"got {self.num_embeddings} x {self.embedding_dim}"
            )
        self.data_type = DataType(self.data_type)
        self.feature_names = list(self.feature_names)
        seen = set()
        for feature in self.feature_names:
            if feature in seen:
                raise ValueError(f"table '{self.name}' declares feature '{feature}' twice")
            seen.add(feature)
        if self.get_weight_init_min() > self.get_weight_init_max():
            raise ValueError(
                f"table '{self.name}': weight_init_min {self.get_weight_init_min()} > "
                f"weight_init_max {self.get_weight_init_max()}"
            )

    def get_weight_init_max(self) -> float:
        return math.sqrt(1.0 / self.num_embeddings) if self.weight_init_max is None else self.weight_init_max

    def get_weight_init_min(self) -> float:
        return -math.sqrt(1.0 / self.num_embeddings) if self.weight_init_min is None else self.weight_init_min

    def num_features(self) -> int:
        return len(self.feature_names)

    @property
    def dtype(self) -> torch.dtype:
        return data_type_to_dtype(self.data_type)

    def init_weight_(self, weight: torch.Tensor) -> None:
        """Initialize ``weight`` (this table's rows, or a shard of them) in place."""
        with torch.no_grad():
            if self.init_fn is not None:
                result = self.init_fn(weight)
                # init_fn may work out of place and return the new values instead
                if result is not None and result is not weight:
                    weight.copy_(result)
            else:
                weight.uniform_(self.get_weight_init_min(), self.get_weight_init_max())


@dataclass
class EmbeddingBagConfig(BaseEmbeddingConfig):
    """A table whose bags are pooled (SUM or MEAN) into one ``[embedding_dim]`` vector per sample."""

    pooling: PoolingType = PoolingType.SUM

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pooling = PoolingType(self.pooling)
        if self.pooling is PoolingType.NONE:
            raise ValueError(
                f"table '{self.name}': an EmbeddingBagConfig pools (SUM or MEAN); "
                "use EmbeddingConfig for unpooled (sequence) lookups"
            )


@dataclass
class EmbeddingConfig(BaseEmbeddingConfig):
    """A table looked up without pooling: one ``[embedding_dim]`` vector per id."""

    @property
    def pooling(self) -> PoolingType:
        return PoolingType.NONE


@dataclass
class EmbeddingTableConfig(BaseEmbeddingConfig):
    """A table as the sharding code sees it (torchrec's ``EmbeddingTableConfig``): the base config plus
    how its bags are pooled and what its lookups are called.

    pooling: ``PoolingType`` of its bags (NONE: one row per id). is_weighted: the input carries a
    weight per id. has_feature_processor: a feature processor runs before the lookup.
    embedding_names: the output name of each feature (a feature's name, or ``feature@table``).
    pruning_indices_remapping / need_pos: kept for torchrec's signature; shardkit's trainable
    modules do not prune rows and give positions through their feature processors.
    """

    pruning_indices_remapping: Optional[torch.Tensor] = None
    need_pos: bool = False
    pooling: PoolingType = PoolingType.SUM
    is_weighted: bool = False
    has_feature_processor: bool = False
    embedding_names: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pooling = PoolingType(self.pooling)
        self.embedding_names = list(self.embedding_names)
        if self.embedding_names and len(self.embedding_names) != len(self.feature_names):
            raise ValueError(
                f"table '{self.name}': {len(self.embedding_names)} embedding_names for "
                f"{len(self.feature_names)} feature_names"
            )


def check_table_configs(tables: Sequence[BaseEmbeddingConfig], config_type: type) -> Dict[str, List[str]]:
    """Validate a collection's tables; returns ``{feature name: [table names]}`` in declaration order.

    A feature may be looked up by several tables (its outputs are then named ``feature@table``, see
    :func:`embedding_names_by_table`). Raises ``ValueError`` for an empty list, a config of the wrong
    type, a table without features or duplicate table names.
    """
    if len(tables) == 0:
        raise ValueError("an embedding collection needs at least one table")
    feature_to_tables: Dict[str, List[str]] = {}
    table_names = set()
    for table in tables:
        if not isinstance(table, config_type):
            raise TypeError(f"expected {config_type.__name__} tables, got {type(table).__name__} '{table}'")
        if table.name in table_names:
            raise ValueError(f"duplicate table name '{table.name}'")
        table_names.add(table.name)
        if not table.feature_names:
            raise ValueError(f"table '{table.name}' has no feature_names: nothing would look it up")
        for feature in table.feature_names:
            feature_to_tables.setdefault(feature, []).append(table.name)
    return feature_to_tables


def embedding_names_by_table(tables: Sequence[BaseEmbeddingConfig]) -> List[List[str]]:
    """Each table's output names, as torchrec: a feature's name, or ``feature@table`` for a feature
    that several tables look up."""
    count: Dict[str, int] = {}
    for table in tables:
        for feature in table.feature_names:
            count[feature] = count.get(feature, 0) + 1
    return [[f if count[f] == 1 else f"{f}@{t.name}" for f in t.feature_names] for t in tables]
