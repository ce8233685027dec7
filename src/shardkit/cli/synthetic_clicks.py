"""Moved: ``SyntheticClicks`` is ``shardkit.datasets.SyntheticClicks``; this keeps the old import path."""

from shardkit.datasets import SyntheticClicks

__all__ = ["SyntheticClicks"]
