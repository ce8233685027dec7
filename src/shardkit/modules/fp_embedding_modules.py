"""torchrec's module path ``torchrec.modules.fp_embedding_modules``.

The class lives in ``fp_embedding_bag_collection.py``; this module keeps torchrec's import path working
(re-exports only, docs/names.md "torchrec's module tree").
"""

from shardkit.modules.fp_embedding_bag_collection import FeatureProcessedEmbeddingBagCollection

__all__ = ["FeatureProcessedEmbeddingBagCollection"]
