"""Train / validation splits of a data pipe, torchrec's ``idx_split_train_val`` and ``rand_split_train_val``.

Both return two pipes over the same source that together yield each item exactly once, in the source's
order, and make the same split on every pass (every epoch, every rank).
"""

from __future__ import annotations

import random
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Tuple

from shardkit.datasets.datapipe import IterDataPipe


def _identity(idx: int) -> int:
    return idx


def train_filter(key_fn: Callable[[int], int], train_perc: float, decimal_places: int, idx: int) -> bool:
    """Whether item ``idx`` is in the train split: the last ``decimal_places`` decimal digits of
    ``key_fn(idx)`` are below ``train_perc`` scaled to that many digits (0.75, 2 places: ``< 75``)."""
    scale = 10**decimal_places
    return key_fn(idx) % scale < round(train_perc * scale)


def val_filter(key_fn: Callable[[int], int], train_perc: float, decimal_places: int, idx: int) -> bool:
    """Whether item ``idx`` is in the validation split: exactly when it is not in the train split."""
    return not train_filter(key_fn, train_perc, decimal_places, idx)


def _check_train_perc(train_perc: float) -> None:
    if not 0.0 < train_perc < 1.0:
        raise ValueError(f"train_perc must be in range (0.0, 1.0), got {train_perc}")


class _IdxFilter(IterDataPipe):
    """The items of ``datapipe`` whose position ``idx`` passes ``filter_fn(idx)``."""

    def __init__(self, datapipe: Iterable[Any], filter_fn: Callable[[int], bool]) -> None:
        super().__init__()
        self.datapipe, self.filter_fn = datapipe, filter_fn

    def __iter__(self) -> Iterator[Any]:
        for idx, item in enumerate(self.datapipe):
            if self.filter_fn(idx):
                yield item


def idx_split_train_val(
    datapipe: Iterable[Any],
    train_perc: float,
    decimal_places: int = 2,
    key_fn: Callable[[int], int] = _identity,
) -> Tuple[IterDataPipe, IterDataPipe]:
    """``(train, val)`` pipes split by item position: item ``idx`` is in train when
    ``train_filter(key_fn, train_perc, decimal_places, idx)`` (with the default ``key_fn``, the first
    75 of every 100 items for ``train_perc=0.75``). ``train_perc`` must be in (0, 1)."""
    _check_train_perc(train_perc)
    return (
        _IdxFilter(datapipe, partial(train_filter, key_fn, train_perc, decimal_places)),
        _IdxFilter(datapipe, partial(val_filter, key_fn, train_perc, decimal_places)),
    )


class _RandFilter(IterDataPipe):
    """The items of ``datapipe`` for which ``filter_fn(rand_gen)`` is true; ``rand_gen`` is restored to
    its state at construction at the start of every pass, so each pass draws the same numbers."""

    def __init__(
        self, datapipe: Iterable[Any], filter_fn: Callable[[random.Random], bool], rand_gen: random.Random
    ) -> None:
        super().__init__()
        self.datapipe, self.filter_fn, self.rand_gen = datapipe, filter_fn, rand_gen
        self.rand_gen_init_state = rand_gen.getstate()

    def __iter__(self) -> Iterator[Any]:
        self.rand_gen.setstate(self.rand_gen_init_state)
        for item in self.datapipe:
            if self.filter_fn(self.rand_gen):
                yield item


def _rand_in_train(train_perc: float, rand_gen: random.Random) -> bool:
    return rand_gen.random() < train_perc


def _rand_in_val(train_perc: float, rand_gen: random.Random) -> bool:
    return not _rand_in_train(train_perc, rand_gen)


def rand_split_train_val(
    datapipe: Iterable[Any], train_perc: float, random_seed: int = 0
) -> Tuple[IterDataPipe, IterDataPipe]:
    """``(train, val)`` pipes split at random: item ``i`` is in train when the ``i``-th draw of
    ``random.Random(random_seed).random()`` is below ``train_perc`` (so about that fraction, not
    exactly). The same seed gives the same split, as torchrec's. ``train_perc`` must be in (0, 1)."""
    _check_train_perc(train_perc)
    return (
        _RandFilter(datapipe, partial(_rand_in_train, train_perc), random.Random(random_seed)),
        _RandFilter(datapipe, partial(_rand_in_val, train_perc), random.Random(random_seed)),
    )


__all__ = ["idx_split_train_val", "rand_split_train_val", "train_filter", "val_filter"]
