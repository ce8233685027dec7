"""``Pending``: a started exchange of the comm ops and what its ``wait()`` returns."""

from __future__ import annotations

from typing import Callable, Generic, Optional, TypeVar

import torch.distributed as dist

T = TypeVar("T")
U = TypeVar("U")


class Pending(Generic[T]):
    """Started communication: ``wait()`` completes ``work`` (None: nothing to wait for) -> ``finish()``.

    ``divided``: a backward exchange whose copies already divided the gradients by the world size
    (gradient division done in the same pass; the caller must not divide again).
    """

    def __init__(self, work: Optional[dist.Work], finish: Callable[[], T], divided: bool = False) -> None:
        self._work = work
        self._finish = finish
        self.divided = divided

    def wait(self) -> T:
        if self._work is not None:
            self._work.wait()
        return self._finish()

    def then(self, post: Callable[[T], U]) -> Pending[U]:
        """The same communication, with ``post`` applied to its result (still ``divided`` if it was)."""
        finish = self._finish
        return Pending(self._work, lambda: post(finish()), self.divided)


__all__ = ["Pending"]
