"""torchrec's ``torchrec.streamable`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.distributed.absent_names import absent
from shardkit.distributed.multistreamable import Multistreamable

__all__ = ["Multistreamable"]

# torchrec's names here that shardkit lacks: importing one is an ImportError naming it
__getattr__ = absent(__name__, ["Pipelineable"])
