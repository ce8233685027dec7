"""Independent subprocess runs of a test module, two at a time in the background.

Each of these tests waits for one slow, independent program (a doc block, a 2-rank job), most of whose
time is one core's work: starting Python and importing torch. ``PairedRuns.result(key)`` starts that
key's run and the next key's (in the module's order) in the background, then waits for its own, so two
runs overlap on a 2-core machine while a test selected alone (``-k``) starts at most one extra run.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, Hashable, List


class PairedRuns:
    def __init__(self, keys: List[Hashable], run: Callable[[Hashable], Any]):
        self._keys = list(keys)
        self._run = run
        self._started: Dict[Hashable, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="paired-run")

    def result(self, key: Hashable) -> Any:
        at = self._keys.index(key)
        for each in self._keys[at : at + 2]:
            if each not in self._started:
                self._started[each] = self._pool.submit(self._run, each)
        return self._started[key].result()
