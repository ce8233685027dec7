"""The one registry of module-level state in shardkit, so that it can be reset in one call.

Module-level state exists only where a specified API demands it (the gp_utils functions, the cached
intra/cross-node groups). Each such module registers a reset function here; ``reset_all`` runs them,
for example before ``destroy_process_group`` in a long-lived test worker.
"""

from __future__ import annotations

from typing import Callable

_RESETS: dict[str, Callable[[], None]] = {}


def register_reset(name: str, reset: Callable[[], None]) -> None:
    """Register ``reset`` under ``name`` (re-registering a name replaces it)."""
    _RESETS[name] = reset


def reset_all() -> None:
    """Run every registered reset function."""
    for reset in list(_RESETS.values()):
        reset()
