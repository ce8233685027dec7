"""Alternating rounds: how calibrate() times its steps on a machine whose load drifts.

Every round runs each step (a few times) in an order that changes from round to round, so that the
load's drift hits all steps alike and no step always runs first or after the same one; a step's figure
is the median over rounds (``calibration_steps`` fits the cost model to them). Also the write of a
freshly allocated buffer timed in the same rounds (``calibration.measure_fresh_buffer_bw``, the fit's
fallback price of fresh bytes).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

MIB = 1 << 20
# alternating rounds of the timed steps: on a machine whose cores other work shares, a step's time
# over rounds spreads by 1.5-4x (min to max) and the median of 5 rounds of one plan moved by up to 1.6x
# between two copies of it (docs/planner.md, "Plan quality"); 9 rounds cost ~1.8x the time of 5
ROUNDS = 9
STEPS_PER_ROUND = 2


def round_order(n: int, round_index: int) -> List[int]:
    """The order in which round ``round_index`` runs ``n`` steps: round 0 in the given order, every
    other a permutation drawn from a generator seeded by the round (the same on every rank: the steps
    are collectives). A fixed order put the same steps first in every round (the tiny table-wise
    steps, which an idle 2-rank calibration measured 1.3-1.7x their fitted times: the order is a
    suspect, not shown to be the cause), and a rotation keeps every step after the same one."""
    if round_index == 0:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(round_index)).tolist()


def alternating_seconds(
    steps: Sequence[Callable[[], None]],
    pg: Optional[dist.ProcessGroup],
    device: torch.device,
    rounds: int = ROUNDS,
    per_round: int = STEPS_PER_ROUND,
    warmup: int = 2,
    once: Sequence[bool] = (),
) -> List[float]:
    """Seconds per step of each of ``steps``: every round runs ``per_round`` steps of each (one of a
    step whose ``once`` is True: a slow step), in the order ``round_order`` (so a machine's load
    drifting during the measurement hits them all alike, and no step always runs first or after the
    same one); per step function, the median over rounds of the round's mean. This rank's figures
    (the caller agrees on the slowest)."""
    for step in steps:
        for _ in range(warmup):
            step()
    times: List[List[float]] = [[] for _ in steps]
    for r in range(rounds):
        for i in round_order(len(steps), r):
            step = steps[i]
            n = 1 if i < len(once) and once[i] else per_round
            dist.barrier(group=pg)
            start = time.perf_counter()
            for _ in range(n):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[i].append((time.perf_counter() - start) / n)
    return [statistics.median(t) for t in times]


# the fresh buffer written in the alternating rounds (CostModel.fresh_buffer_bw): above glibc's largest
# mmap threshold (32 MiB), so the allocator takes it from the system and every write pays the page faults
FRESH_BYTES = 64 * MIB


def fresh_write_step(device: torch.device, nbytes: int = FRESH_BYTES) -> Callable[[], None]:
    """A step that allocates ``nbytes``, writes them once and frees them: what a backward making its
    buffers every step pays per byte (page faults included on CPU)."""

    def step() -> None:
        torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)

    return step


__all__ = [
    "FRESH_BYTES",
    "ROUNDS",
    "STEPS_PER_ROUND",
    "alternating_seconds",
    "fresh_write_step",
    "round_order",
]
