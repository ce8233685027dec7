"""shardkit.testing.process_memory: the resident-set figures the offload memory tests and benchmarks read."""

from __future__ import annotations

import sys

import pytest
import torch

from shardkit.testing.process_memory import memory_mib, reset_peak

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")


def test_the_peak_follows_a_touched_buffer_and_resets_to_the_resident_set():
    assert reset_peak()
    before = memory_mib()
    assert before["VmRSS"] > 0 and before["VmHWM"] >= before["VmRSS"] - 1.0  # reset: peak ~ resident
    buffer = torch.ones(48 << 18)  # 48 MiB, every page written
    grown = memory_mib()
    assert grown["VmHWM"] - before["VmHWM"] >= 40.0, (before, grown)
    del buffer
    assert reset_peak()
    after = memory_mib()
    assert after["VmHWM"] < grown["VmHWM"] - 40.0, (grown, after)  # the freed pages left the peak
