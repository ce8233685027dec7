"""``CombinedOptimizer`` lives in ``shardkit.optim.keyed`` (torchrec's ``torchrec.optim.keyed``); this
module keeps the old import path."""

from shardkit.optim.keyed import CombinedOptimizer

__all__ = ["CombinedOptimizer"]
