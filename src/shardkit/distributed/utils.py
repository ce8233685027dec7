"""torchrec's ``torchrec.distributed.utils`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.distributed.absent_names import absent
from shardkit.model_parallel.copying import sharded_model_copy
from shardkit.sharding.dist_data.permute import PermutePooledEmbeddings
from shardkit.sharding.utils import (
    CopyableMixin,
    add_params_from_parameter_sharding,
    add_prefix_to_state_dict,
    append_prefix,
    copy_to_device,
    filter_state_dict,
    get_unsharded_module_names,
    init_parameters,
    merge_fused_params,
    none_throws,
    optimizer_type_to_emb_opt_type,
)

__all__ = [
    "CopyableMixin",
    "PermutePooledEmbeddings",
    "add_params_from_parameter_sharding",
    "add_prefix_to_state_dict",
    "append_prefix",
    "copy_to_device",
    "filter_state_dict",
    "get_unsharded_module_names",
    "init_parameters",
    "merge_fused_params",
    "none_throws",
    "optimizer_type_to_emb_opt_type",
    "sharded_model_copy",
]

# torchrec's names here that shardkit lacks: importing one is an ImportError naming it
__getattr__ = absent(__name__, ["convert_to_fbgemm_types"])
