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

A survivor does not always see a timeout of its own. gloo closes every connection of a group on the
rank whose wait timed out first, and a survivor still waiting on such a connection (it entered the
collective a moment later, or its wait runs longer) gets "Connection closed by peer" instead. That
error (:func:`is_peer_closed`) starts the roll call too, and becomes the same named error. A rank
that leaves for an error of its own (a bug, bad input) and closes its connections is not silent: the
code that ends a rank (the test harness's workers, ``shardkit launch``) runs under
``naming_silent_ranks(leaving=True)``, which marks such a rank in the store, and the survivors it cut
off stop their roll call at once and raise their own error unchanged: the failed rank's error is the
one to read.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, List, Optional

import torch.distributed as dist

ENV_VAR = "SHARDKIT_TIMEOUT"
# the timeout of the process groups shardkit's own entry points create when neither SHARDKIT_TIMEOUT
# nor the script says otherwise (shardkit launch; NCCL's own default in recent torch, a third of gloo's)
DEFAULT_TIMEOUT_S = 600.0
_ROLL_CALL = "shardkit/roll_call/"
# a rank that left with an error of its own (``naming_silent_ranks(leaving=True)``): 1 once marked
_LEFT = "shardkit/roll_call_left/"
# words of torch's timeout errors: gloo ("Timed out waiting ..."), NCCL's watchdog ("... timeout"),
# the store ("Wait timeout")
_TIMEOUT_WORDS = ("timed out", "timeout")
# gloo's words when the other end of a connection went away: that rank's own wait timed out (gloo
# then closes all its connections of the group) or it left (an error, its group destroyed) ...
# (read: "Connection closed by peer", "Read error ...: Connection reset by peer"; write: "Broken
# pipe"; an operation on a connection already closed: "Socket closed", "Socket unexpectedly closed")
_PEER_CLOSED_WORDS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
    "socket unexpectedly closed",
)
# ... but not when a group's connections could not be set up at all ("Gloo connectFullMesh failed
# ... Connection closed by peer"): a failure of the machine, which the test harness runs again
_SET_UP_WORDS = ("connectfullmesh",)


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the process group's timeout, here or on a peer that then
    closed its connections; names the silent ranks."""


class PeerWaitTimeoutError(CollectiveTimeoutError):
    """A wait of one group's collective for the peers it names timed out (the shared-memory exchange).
    A peer named may itself be waiting for a rank of another group: :func:`naming_silent_ranks` treats
    it as a timeout and names the ranks that went silent (a roll call of every rank)."""


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
    if isinstance(err, PeerWaitTimeoutError):
        return True
    if isinstance(err, CollectiveTimeoutError):
        return False
    text = str(err).lower()
    return isinstance(err, (RuntimeError, TimeoutError)) and any(word in text for word in _TIMEOUT_WORDS)


def is_peer_closed(err: BaseException) -> bool:
    """Whether ``err`` is gloo's report that a peer closed a connection of a working group (the peer
    timed out or left); False for a group whose connections could not be set up."""
    if isinstance(err, CollectiveTimeoutError) or not isinstance(err, RuntimeError):
        return False
    text = str(err).lower()
    return any(word in text for word in _PEER_CLOSED_WORDS) and not any(
        word in text for word in _SET_UP_WORDS
    )


def _after_a_roll_call(err: Optional[BaseException]) -> bool:
    """Whether ``err`` or an error in its chain is a timeout, a closed peer or a roll call's verdict:
    a rank leaving with it has answered (or will answer) the roll call, it did not fail on its own."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, CollectiveTimeoutError) or is_timeout(err) or is_peer_closed(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _default_store():
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


@dataclass(frozen=True)
class RollCall:
    """The outcome of :func:`roll_call`: ``silent`` did not answer within the grace; ``left`` left
    with an error of their own (not silent: they closed their connections on the way out)."""

    silent: List[int]
    left: List[int]


def roll_call(grace_s: float = 5.0, stop_when_one_left: bool = False) -> RollCall:
    """Which ranks of the default group answer a roll call within ``grace_s`` seconds.

    Every caller marks itself present in the default group's store (one counter per rank, so a later
    roll call is not answered by an earlier one) and waits for the others to reach the same count, or
    to be marked as having left with their own error (:func:`naming_silent_ranks` with
    ``leaving=True``); with ``stop_when_one_left``, the first such rank ends the wait (the ranks still
    unanswered may only be waiting in a collective that rank cut off, not silent). Empty when the
    default group is not initialized or has no store.
    """
    store = _default_store()
    if store is None:
        return RollCall([], [])
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = store.add(f"{_ROLL_CALL}{rank}", 1)
    deadline = time.monotonic() + grace_s
    missing = [r for r in range(world) if r != rank]
    left: List[int] = []
    while missing:
        left += [r for r in missing if store.add(f"{_LEFT}{r}", 0) > 0]
        missing = [r for r in missing if r not in left and store.add(f"{_ROLL_CALL}{r}", 0) < mine]
        if not missing or time.monotonic() >= deadline or (left and stop_when_one_left):
            break
        time.sleep(0.1)
    return RollCall(missing, sorted(left))


def silent_ranks(grace_s: float = 5.0) -> List[int]:
    """The ranks of the default group that do not answer a roll call within ``grace_s`` seconds
    (:func:`roll_call`; a rank that left with its own error is not silent)."""
    return roll_call(grace_s).silent


def mark_left() -> None:
    """Mark this rank, in the default group's store, as leaving with an error of its own, so that the
    peers its closing connections cut off neither wait out a roll call for it nor name it silent.
    For the code that ends a rank; best effort (nothing when the store cannot be reached)."""
    store = _default_store()
    if store is None:
        return
    try:
        store.add(f"{_LEFT}{dist.get_rank()}", 1)
    except (RuntimeError, ValueError):
        pass  # the store is gone: the peers' roll call names this rank silent, as before


@contextlib.contextmanager
def naming_silent_ranks(grace_s: float = 5.0, leaving: bool = False) -> Iterator[None]:
    """Turn a collective timeout inside the block, or a peer closing its connections (a survivor that
    timed out first, :func:`is_peer_closed`), into a :class:`CollectiveTimeoutError` naming the ranks
    that went silent (:func:`roll_call`); other errors pass unchanged.

    A closed peer that left with its own error (marked by ``leaving``) is not a silence: the error
    passes unchanged, at once. ``leaving=True`` is for code that ends the rank when the block fails
    (the test harness's workers, ``shardkit launch``): it marks the rank as leaving with its own error
    (:func:`mark_left`) before the error propagates and the rank closes its connections."""
    try:
        yield
    except BaseException as err:
        timed_out = isinstance(err, Exception) and is_timeout(err)
        cut_off = isinstance(err, Exception) and is_peer_closed(err)
        if not (timed_out or cut_off):
            if leaving and not _after_a_roll_call(err):
                mark_left()
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        call = roll_call(grace_s, stop_when_one_left=cut_off)
        if cut_off and call.left:
            raise  # a peer failed on its own and cut this rank off: read that rank's error
        found = []
        if call.silent:
            found.append(f"rank(s) {call.silent} did not answer")
        if call.left:
            found.append(f"rank(s) {call.left} left with an error of their own")
        who = "; ".join(found) or "every rank answered a roll call afterwards"
        what = (
            "a collective timed out"
            if timed_out
            else "a collective was cut off by a peer closing its connections"
        )
        raise CollectiveTimeoutError(
            f"rank {rank}: {what} ({who}); the timeout is set by "
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
    "PeerWaitTimeoutError",
    "RollCall",
    "group_timeout",
    "is_peer_closed",
    "is_timeout",
    "mark_left",
    "naming_silent_ranks",
    "new_group",
    "parse_timeout",
    "process_group_timeout",
    "roll_call",
    "silent_ranks",
    "timeout_from_env",
]
