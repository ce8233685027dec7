"""torchrec's module path ``torchrec.modules.embedding_modules``: the two collections and the naming rule.

The classes live in ``embedding_bag_collection.py`` and ``embedding_collection.py`` (one concept per
file); this module keeps torchrec's import path working.
"""

from shardkit.modules.embedding_bag_collection import EmbeddingBagCollection
from shardkit.modules.embedding_collection import EmbeddingCollection
from shardkit.modules.embedding_configs import embedding_names_by_table as get_embedding_names_by_table

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection", "get_embedding_names_by_table"]
