"""The switch for cross-rank validation that costs a collective or a host sync on a hot path.

Some checks (for example that every rank passes an all-reduce a tensor of the same shape) need an
extra small collective, which also synchronizes the host with the device. They turn a mismatch between
ranks, which would otherwise hang or corrupt memory, into a ``ValueError`` on every rank, so they are on
by default. A training loop whose shapes are known to agree can switch them off:

- ``set_validation(False)`` at run time, or
- the environment variable ``SHARDKIT_VALIDATE=0`` (also ``false``, ``no``, ``off``), read when this
  module is first imported.

Checks that need no communication (argument types, sizes known locally) always run, and so do checks
whose collective an operation needs anyway (the shape exchange of an uneven gather).

The setting is per process. ``shardkit.distributed.state.reset_all`` restores the environment's default.
"""

from __future__ import annotations

import os

import torch

from shardkit.distributed.state import register_reset

ENV_VAR = "SHARDKIT_VALIDATE"
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def _default_from_env() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in _FALSE_WORDS


# one boolean in a list rather than a global statement per setter; read on hot paths, so kept trivial
_ENABLED = [_default_from_env()]


def set_validation(enabled: bool) -> None:
    """Switch collective-costing validation on or off for this process."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_validation expects a bool, got {type(enabled).__name__}")
    _ENABLED[0] = enabled


def validation_enabled() -> bool:
    """Whether validation that costs a collective / host sync runs (default on; see the module doc)."""
    return _ENABLED[0]


def host_checks_enabled() -> bool:
    """Whether a check that reads tensor contents on the host (an id range, a bag length) runs:
    validation on, and not while ``torch.export`` / ``torch.compile`` traces (a host read of traced
    values cannot be recorded into a program; the exported program relies on the indexing ops' own
    bounds checks instead, see docs/export.md)."""
    return _ENABLED[0] and not torch.compiler.is_compiling()


def _reset_to_default() -> None:
    _ENABLED[0] = _default_from_env()


# a long-lived test worker must not carry one task's setting into the next
register_reset("validation", _reset_to_default)
