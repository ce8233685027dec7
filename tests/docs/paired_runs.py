"""Independent subprocess runs of a test module, two at a time in the background.

Each of these tests waits for one slow, independent program (a doc block, a 2-rank job), most of whose
time is one core's work: starting Python and importing torch. ``PairedRuns(keys, run)`` is given the
keys of the runs the session will ask for (``selected_params``: only the tests selected, so a test
selected alone with ``-k`` starts no other run), in the order it asks for them. The first
``result(key)`` queues them all on two threads, so two runs are in flight until the last: a long run
no longer leaves the second core idle once the run after it is done (with a look-ahead of one run, as
before, it did). ``close()`` (the module fixture's teardown) drops the runs not started, so a session
stopped early (``-x``) does not wait for them.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, Hashable, List

import pytest


class PairedRuns:
    def __init__(self, keys: List[Hashable], run: Callable[[Hashable], Any]):
        self._keys = list(keys)
        self._run = run
        self._started: Dict[Hashable, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="paired-run")

    def result(self, key: Hashable) -> Any:
        if not self._started:
            # the asked key first: the order of the keys is only the expected order of the asking
            for each in [key, *(k for k in self._keys if k != key)]:
                self._started[each] = self._pool.submit(self._run, each)
        if key not in self._started:  # a key the selection did not list: run it now
            self._started[key] = self._pool.submit(self._run, key)
        return self._started[key].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def selected_params(request: pytest.FixtureRequest, argname: str) -> List[Any]:
    """The values of parameter ``argname`` of the selected tests of the requesting module, in the
    session's order (``request``: a module-scoped fixture's)."""
    return [
        item.callspec.params[argname]
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and hasattr(item, "callspec")
        and argname in item.callspec.params
    ]
