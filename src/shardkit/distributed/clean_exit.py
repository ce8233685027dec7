"""Free, before the interpreter finalizes, process groups that only reference cycles keep alive.

A gloo process group whose worker threads still run when Python finalizes can abort the process
("terminate called without an active exception", docs/running.md). ``destroy_process_group`` frees
the default group only if nothing else refers to it, and shardkit's objects do: a sharded module, its
awaitables and a train pipeline hold the group, and some of them sit in reference cycles (a module
whose ``forward`` is a pipeline's wrapper of it, an awaitable whose callback reads the awaitable).
A function that built them returns, the cycles become garbage, but only the cyclic garbage
collector frees them, at a time of its choosing: measured with examples/dlrm_criteo.py on 2 ranks,
3 gloo threads per rank were still running after ``destroy_process_group`` and at exit.

Importing this module registers a ``gc.collect()`` as an exit handler: it runs before finalization
(atexit handlers run first), so the groups those cycles held are freed, and their threads joined,
while the interpreter is still whole. It cannot free a group that something still reaches (a
module-level variable, or a default group never destroyed): rules 1 and 2 of docs/running.md stay.
"""

from __future__ import annotations

import atexit
import gc


def collect_garbage_at_exit() -> None:
    """The exit handler: one full collection (``gc.collect()``)."""
    gc.collect()


atexit.register(collect_garbage_at_exit)

__all__ = ["collect_garbage_at_exit"]
