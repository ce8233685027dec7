"""Bounded waits: a shardkit-level collective timeout, and naming the rank that went silent.

A rank that stalls (a deadlock in user code, a dead GPU, a debugger) leaves the other ranks waiting in
their next collective for the process group's timeout: torch's default is 30 minutes (10 for NCCL
in recent releases). Set it where the group is made::

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))

or, for shardkit's harness (``shardkit.testing.run_world``), ``shardkit demo`` and the CLI, with the
environment variable ``SHARDKIT_TIMEOUT`` (seconds) or their ``--timeout`` option. Every group
shardkit creates itself (:func:`new_group`: the node groups, the graph-parallel grid) takes the
default group's timeout, so that one setting bounds every collective.

When a collective times out, torch's error does not say which rank is missing. Run the code under
:func:`naming_silent_ranks`: a timeout then becomes a :class:`CollectiveTimeoutError` that lists the
ranks that did not answer a roll call through the process group's store (the survivors all answer
within ``grace_s``; a stalled or dead rank does not).
"""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta
from typing import Iterator, List, Optional

import torch.distributed as dist

ENV_VAR = "SHARDKIT_TIMEOUT"
# the timeout of the process groups shardkit's own entry points create when neither SHARDKIT_TIMEOUT
# nor the script says otherwise (shardkit launch; NCCL's own default in recent torch, a third of gloo's)
DEFAULT_TIMEOUT_S = 600.0
_ROLL_CALL = "shardkit/roll_call/"
# words of torch's timeout errors: gloo ("Timed out waiting ..."), NCCL's watchdog ("... timeout"),
# the store ("Wait timeout")
_TIMEOUT_WORDS = ("timed out", "timeout")


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the process group's timeout; names the silent ranks."""


def timeout_from_env(default: timedelta) -> timedelta:
    """``SHARDKIT_TIMEOUT`` (positive seconds) as a timedelta, or ``default`` when it is unset.

    Raises ``ValueError`` naming the variable for a value that is not a positive finite number."""
    raw = os.environ.get(ENV_VAR)
    if raw is None or raw.strip() == "":
        return default
    return timedelta(seconds=parse_timeout(raw, ENV_VAR))


def parse_timeout(raw: str, what: str) -> float:
    """``raw`` as positive finite seconds; ``ValueError`` naming ``what`` otherwise."""
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{what} must be a number of seconds, got {raw[:40]!r}") from None
    if not (0 < seconds < float("inf")):
        raise ValueError(f"{what} must be a positive number of seconds, got {raw[:40]!r}")
    return seconds


def is_timeout(err: BaseException) -> bool:
    """Whether ``err`` is torch's report of a collective or store wait that timed out."""
    if isinstance(err, CollectiveTimeoutError):
        return False
    text = str(err).lower()
    return isinstance(err, (RuntimeError, TimeoutError)) and any(word in text for word in _TIMEOUT_WORDS)


def silent_ranks(grace_s: float = 5.0) -> List[int]:
    """The ranks of the default group that do not answer a roll call within ``grace_s`` seconds.

    Every caller marks itself present in the default group's store (one counter per rank, so a later
    roll call is not answered by an earlier one) and waits for the others to reach the same count.
    Empty when the default group is not initialized or has no store.
    """
    if not dist.is_initialized():
        return []
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return []
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = store.add(f"{_ROLL_CALL}{rank}", 1)
    deadline = time.monotonic() + grace_s
    missing = [r for r in range(world) if r != rank]
    while missing and time.monotonic() < deadline:
        missing = [r for r in missing if store.add(f"{_ROLL_CALL}{r}", 0) < mine]
        if missing:
            time.sleep(0.1)
    return missing


@contextlib.contextmanager
def naming_silent_ranks(grace_s: float = 5.0) -> Iterator[None]:
    """Turn a collective timeout inside the block into a :class:`CollectiveTimeoutError` naming the
    ranks that went silent (:func:`silent_ranks`); other errors pass unchanged."""
    try:
        yield
    except Exception as err:
        if not is_timeout(err):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        silent = silent_ranks(grace_s)
        who = f"rank(s) {silent} did not answer" if silent else "every rank answered a roll call afterwards"
        raise CollectiveTimeoutError(
            f"rank {rank}: a collective timed out ({who}); the timeout is set by "
            f"init_process_group(timeout=...) or {ENV_VAR}. torch said: {str(err)[:300]}"
        ) from err


def process_group_timeout(group: Optional[dist.ProcessGroup] = None) -> Optional[timedelta]:
    """The timeout ``group`` (default: the default group) was created with, or None when torch does
    not expose it (no group, or a backend without options).

    Read from the group's backend options (gloo and NCCL both keep ``_timeout`` there)."""
    if not dist.is_initialized():
        return None
    group = group if group is not None else dist.group.WORLD
    try:
        devices = list(group._device_types)
    except (AttributeError, RuntimeError):
        return None
    for device in devices:
        try:
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


def new_group(ranks, backend: Optional[str] = None) -> dist.ProcessGroup:
    """``torch.distributed.new_group(ranks, backend=backend)`` with the default group's timeout.

    torch gives a group made without ``timeout=`` its own 30-minute default, not the timeout the
    caller chose in ``init_process_group``: a rank stalling in a collective of such a group (the
    node groups of table-row-wise, table-column-wise and grid tables) would keep the others waiting
    for half an hour. Every group shardkit makes goes through here. A collective: every rank of the
    default group calls it, in the same order."""
    return dist.new_group(ranks, backend=backend, timeout=process_group_timeout())


def group_timeout(default_s: Optional[float] = None) -> timedelta:
    """The timeout to create a process group with: ``SHARDKIT_TIMEOUT``, else ``default_s`` seconds,
    else torch's default."""
    fallback = timedelta(seconds=default_s) if default_s is not None else dist.default_pg_timeout
    return timeout_from_env(fallback)


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ENV_VAR",
    "CollectiveTimeoutError",
    "group_timeout",
    "is_timeout",
    "naming_silent_ranks",
    "new_group",
    "parse_timeout",
    "process_group_timeout",
    "silent_ranks",
    "timeout_from_env",
]
