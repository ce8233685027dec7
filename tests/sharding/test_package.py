"""``shardkit.sharding`` exports its public names once each, and they resolve."""

from __future__ import annotations

import shardkit.sharding as sharding
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharded_state import to_state_value


def test_every_exported_name_resolves_once():
    assert len(set(sharding.__all__)) == len(sharding.__all__)
    missing = [name for name in sharding.__all__ if not hasattr(sharding, name)]
    assert not missing, missing
    assert sharding.EmbeddingBagCollectionSharder is EmbeddingBagCollectionSharder
    assert sharding.to_state_value is to_state_value
