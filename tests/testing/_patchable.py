"""A module whose attributes the harness tests patch inside worker processes (test_harness.py)."""

from __future__ import annotations

from typing import Optional

# a constant a test may lower for speed, as tests/planner/test_calibration_steps.py does with BIG_BYTES
BIG_BYTES = 1 << 20
# lazily built process-wide state (like a loaded native library): kept for the worker's lifetime
_LIBRARY: Optional[str] = None
_loaded = False


def measure() -> str:
    """What an unpatched worker reports."""
    return "real"


def state() -> tuple:
    return measure(), BIG_BYTES, _LIBRARY, _loaded
