"""The process-wide switches whose disagreement between ranks would hang them or change results.

``set_validation`` / ``SHARDKIT_VALIDATE`` decides which checking collectives run, and
``set_gradient_division`` how the comm ops scale gradients. Each is per process, so one rank can be
set differently from the others: the ranks then make different collectives (a hang) or train with
different gradients (silent corruption). The sharded modules compare :func:`result_switches` between
ranks when they are built and in every forward's input check, and raise ``ValueError`` on every rank
naming the switch and each rank's value.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence

from shardkit.distributed.comm_ops.request import get_gradient_division
from shardkit.distributed.shm_exchange import shm_exchange_enabled
from shardkit.distributed.validation import validation_enabled

# switches defined in higher layers (e.g. shardkit.sharding's set_ec_index_dedup), registered when
# their module is imported; the sharded modules import them before they compare, so every rank has
# the same names in the same order
_REGISTERED: Dict[str, Callable[[], bool]] = {}


def register_switch(name: str, getter: Callable[[], bool]) -> None:
    """Add a process-wide switch (``getter()`` is this process's value) to :func:`result_switches`."""
    _REGISTERED[name] = getter


def result_switches() -> Dict[str, bool]:
    """``{switch name: this process's value}`` for every switch that must agree between ranks."""
    return {
        "validation (set_validation / SHARDKIT_VALIDATE)": validation_enabled(),
        "gradient division (set_gradient_division)": get_gradient_division(),
        "shared-memory exchange (set_shm_exchange / SHARDKIT_SHM_EXCHANGE)": shm_exchange_enabled(),
        **{name: bool(getter()) for name, getter in _REGISTERED.items()},
    }


def switch_disagreements(per_rank: Sequence[Dict[str, bool]]) -> List[str]:
    """One line per switch whose value differs between the ranks of ``per_rank``, with each rank's."""
    lines = []
    for name in per_rank[0]:
        values = [switches.get(name) for switches in per_rank]
        if any(v != values[0] for v in values[1:]):
            lines.append(f"{name}: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
    return lines


__all__ = ["register_switch", "result_switches", "switch_disagreements"]
