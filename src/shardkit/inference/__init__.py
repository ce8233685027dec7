"""Serving a trained model: torchrec.inference's path in shardkit (L4; docs/serving.md).

- :mod:`~shardkit.inference.state_dict_transform`: ``state_dict_gather`` / ``state_dict_to_device``,
  a sharded state dict gathered onto one rank or moved to a device.
"""

from shardkit.inference.state_dict_transform import (
    state_dict_all_gather_keys,
    state_dict_gather,
    state_dict_to_device,
)

__all__ = ["state_dict_all_gather_keys", "state_dict_gather", "state_dict_to_device"]
