"""Graph parallelism: a data-parallel x graph-parallel grid of ranks and the gp_utils API on it."""

from shardkit.graph_parallel import gp_utils
from shardkit.graph_parallel.gp_utils import *  # noqa: F403 - the public names are gp_utils.__all__

__all__ = ["gp_utils", *gp_utils.__all__]
