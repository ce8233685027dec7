"""The state of a managed collision module: its checks and the eviction windows in its state dict.

:class:`MCHStateChecks` is the part of :class:`~shardkit.modules.mc_modules.MCHManagedCollisionModule`
that checks a state (the sorted id -> slot map, the saved bucket count, each bucket's eviction window),
most of it without writing anything, so that ``shardkit.checkpoint.load`` can refuse a bad state before
anything changes, and installs it after a load; the module-level hooks carry the windows through
``state_dict`` / ``load_state_dict``. The state's
layout is in mc_modules.py's docstring.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

EMPTY_SLOT_ID = torch.iinfo(torch.int64).max
WINDOW_KEY = "_mch_window_"  # + global bucket: the state-dict key of a bucket's eviction window


class MCHStateChecks:
    """State checks and window (de)serialization of an MCH module (a mixin: it reads the module's
    buffers and its ``_label``, ``_buckets``, ``_first_bucket``, ``_bucket_size``, ... attributes)."""

    # ---- the map --------------------------------------------------------------------------------

    def validate_state(self) -> None:
        problem = self.map_problem(
            self._mch_sorted_raw_ids, self._mch_remapped_ids_mapping, int(self._buckets_tensor)
        )
        if problem is not None:
            raise ValueError(problem)
        self._history = [[] for _ in range(self._buckets)]
        self._evicted = []
        windows, self._loaded_windows = self._loaded_windows, {}
        for bucket, window in windows.items():
            self._restore_window(bucket, window)

    # ---- the eviction window in the state -------------------------------------------------------

    def window_key(self, bucket: int) -> str:
        """The state-dict key (under the module's prefix) of local ``bucket``'s window; named by the
        global bucket, so that a row shard's module and the whole map use the same keys."""
        return f"{WINDOW_KEY}{self._first_bucket + bucket}"

    def window_state(self, bucket: int) -> Tuple[torch.Tensor]:
        """Local ``bucket``'s eviction window as its state-dict value: ``([3, n] int64,)``, the distinct
        ids profiled since the bucket's last eviction (ascending), their counts and the last iteration
        each was seen in: all an eviction reads of them. A tuple, so that checkpoints store it as one
        record of its own size (DCP plans tensors by the loading model's shapes; the window's size is
        the saved run's) and plain ``torch.save`` / ``load_state_dict`` carry it as it is."""
        return (torch.stack(self._aggregate(bucket)),)

    def window_problem(self, bucket: int, value: Any, current_iter: int) -> Optional[str]:
        """What is wrong with a saved window for local ``bucket`` (see :meth:`window_state`), given the
        loaded iteration count, or None."""
        where = f"{self._label}: the window of bucket {self._first_bucket + bucket}"
        if not (isinstance(value, (tuple, list)) and len(value) == 1 and type(value[0]) is torch.Tensor):
            return f"{where} is {type(value).__name__}, not a tuple of one tensor"
        window = value[0]
        if window.dtype != torch.int64 or window.dim() != 2 or window.shape[0] != 3:
            return f"{where} is {window.dtype} of shape {list(window.shape)}, not int64 [3, n]"
        if window.shape[1] == 0:
            return None
        ids, counts, last = window
        low = (self._first_bucket + bucket) * self._bucket_id_range
        high = min(low + self._bucket_id_range, self._input_hash_size)
        since = current_iter - current_iter % self._eviction_interval  # the window's last eviction
        if bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < low or int(ids[-1]) >= high:
            return f"{where} does not hold distinct ascending ids of the bucket's range [{low}, {high})"
        if bool((counts < 1).any()) or bool((last <= since).any()) or bool((last > current_iter).any()):
            return (
                f"{where} has counts below 1 or iterations outside ({since}, {current_iter}] (the "
                f"iterations since its last eviction, for a state at iteration {current_iter})"
            )
        return None

    def _restore_window(self, bucket: int, window: torch.Tensor) -> None:
        ids, counts, last = window.to(self._mch_sorted_raw_ids.device)
        if ids.numel():
            # one piece that aggregates to the same (ids, counts, last) as the saved history did
            self._history[bucket] = [(ids.repeat_interleave(counts), last.repeat_interleave(counts))]

    def map_problem(self, sorted_ids: torch.Tensor, mapping: torch.Tensor, buckets: int) -> Optional[str]:
        """What is wrong with a candidate state of this module (``[zch_size]`` int64 ids and slots, the
        saved bucket count), or None; reads only its arguments, so a load can check before it writes."""
        if buckets != self._total_buckets:
            return (
                f"{self._label}: the loaded state has {buckets} buckets, this module "
                f"{self._total_buckets}; a map cannot be re-cut into other buckets"
            )
        size = self._bucket_size
        for name, value in (("_mch_sorted_raw_ids", sorted_ids), ("_mch_remapped_ids_mapping", mapping)):
            if value.dtype != torch.int64 or tuple(value.shape) != (self._zch_size,):
                return (
                    f"{self._label}: the loaded {name} is {value.dtype} of shape {list(value.shape)}, "
                    f"not int64 of shape [{self._zch_size}]"
                )
        ids = sorted_ids.view(self._buckets, size)
        slots = mapping.view(self._buckets, size) - self._output_global_offset
        expected_bucket = torch.arange(self._buckets, device=slots.device).unsqueeze(1)
        if bool((ids[:, 1:] < ids[:, :-1]).any()) or bool((slots // size != expected_bucket).any()):
            return f"{self._label}: the loaded state is not a sorted map of each bucket's slots"
        if bool((ids[:, -1] != EMPTY_SLOT_ID).any()) or bool((slots[:, -1] % size != size - 1).any()):
            return f"{self._label}: the loaded state does not keep each bucket's last slot free"
        return None

    def check_state_dict(self, state_dict: Dict[str, Any], prefix: str) -> List[str]:
        """Problems loading ``state_dict`` (keys under ``prefix``) would raise, found without writing
        anything: ``shardkit.checkpoint.load`` asks every module that has this method first, so that
        a refused state leaves the whole model as it was."""
        current = dict(self.named_buffers(recurse=False))
        values = {name: state_dict.get(prefix + name, current[name]) for name in current}
        if any(type(v) is not torch.Tensor for v in values.values()):
            # a shard's module inside a ShardedManagedCollisionCollection: its state values are the
            # collection's (DTensor / ShardedTensor), which checks them itself
            return []

        def value(name: str) -> torch.Tensor:
            return values[name]

        buckets = value("_buckets_tensor")
        problem = self.map_problem(
            value("_mch_sorted_raw_ids"),
            value("_mch_remapped_ids_mapping"),
            int(buckets.reshape(-1)[0]) if buckets.numel() == 1 else -1,
        )
        problems = [] if problem is None else [problem]
        current_iter = int(value("_current_iter_tensor").reshape(-1)[0])
        for bucket in range(self._buckets):
            key = prefix + self.window_key(bucket)
            if key in state_dict:
                problem = self.window_problem(bucket, state_dict[key], current_iter)
                problems += [] if problem is None else [problem]
        return problems


def validate_after_load(module: nn.Module, incompatible_keys) -> None:
    module.validate_state()  # a module-level function: the module stays picklable


def window_to_state_dict(module: MCHStateChecks, state_dict, prefix: str, local_metadata) -> None:
    for bucket in range(module.buckets()):
        state_dict[prefix + module.window_key(bucket)] = module.window_state(bucket)


def window_from_state_dict(
    module: MCHStateChecks,
    state_dict,
    prefix: str,
    local_metadata,
    strict: bool,
    missing_keys: List[str],
    unexpected_keys: List[str],
    error_msgs: List[str],
) -> None:
    """Take the buckets' windows out of ``state_dict`` (checked); ``validate_state`` installs them."""
    iteration = state_dict.get(prefix + "_current_iter_tensor", module._current_iter_tensor)
    current_iter = int(iteration.reshape(-1)[0]) if isinstance(iteration, torch.Tensor) else -1
    module._loaded_windows = {}
    for bucket in range(module.buckets()):
        key = prefix + module.window_key(bucket)
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            continue
        value = state_dict.pop(key)
        problem = module.window_problem(bucket, value, current_iter)
        if problem is not None:
            error_msgs.append(problem)
            continue
        module._loaded_windows[bucket] = value[0]
