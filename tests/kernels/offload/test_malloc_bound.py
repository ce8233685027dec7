"""A process holding an offloaded table returns freed large blocks to the system whatever ran before
(kernels/offload/malloc_bound.py): glibc's dynamic mmap / trim thresholds otherwise keep freed 16 MiB
checkpoint pieces resident after the process once freed a larger block. Memory numbers, no timings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardkit.kernels.offload import malloc_bound

_CHILD = r"""
import json, sys, tempfile
import torch
from shardkit.kernels.offload.backing_store import BackingStore

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10

store = BackingStore.create({"w": ((16, 4), torch.float32)}, {"t": 1}, tempfile.mkdtemp())
big = torch.empty(32 << 18)  # 32 MiB, freed: glibc's dynamic thresholds rise to 32 / 64 MiB
big.fill_(1)
del big
base = anon()
kept = []
retained = 0
for i in range(8):  # 16 MiB pieces as a checkpoint load reads them, a small block kept after each
    piece = torch.empty(16 << 18)
    piece.fill_(i)
    kept.append(torch.ones(64))
    del piece
    retained = max(retained, anon() - base)
print(json.dumps({"retained": retained}))
"""


def _retained(monkeypatch, **env) -> int:
    """Peak resident growth (bytes) of a child holding a backing store while it frees 16 MiB pieces."""
    monkeypatch.delenv(malloc_bound.MALLOC_THRESHOLD_ENV, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["retained"]


glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or malloc_bound.platform.libc_ver()[0] != "glibc",
    reason="glibc's malloc thresholds only",
)


@glibc_only
def test_freed_pieces_are_not_kept_resident_after_a_larger_free(monkeypatch):
    retained = _retained(monkeypatch)
    assert retained < 4 << 20, f"{retained / 2**20:.1f} MiB of freed 16 MiB pieces stayed resident"


@glibc_only
def test_the_child_shows_the_retention_when_malloc_is_left_alone(monkeypatch):
    # what the fix is for, measured with the same child (glibc 2.x: freed pieces stay resident); if a
    # C library stops doing this, this test says so and the fix is moot. Measured: either about one
    # piece stays resident (15.8-16 MiB: the piece less what glibc trims off the top) or most of them
    # (~100 MiB), from run to run; with the fix, under 4 MiB (the test above)
    retained = _retained(monkeypatch, **{malloc_bound.MALLOC_THRESHOLD_ENV: "off"})
    assert retained >= 8 << 20, f"only {retained / 2**20:.1f} MiB retained with malloc left alone"


def test_threshold_setting_parses_and_rejects_bad_values(monkeypatch):
    monkeypatch.delenv(malloc_bound.MALLOC_THRESHOLD_ENV, raising=False)
    assert malloc_bound.configured_threshold() == malloc_bound.DEFAULT_THRESHOLD
    monkeypatch.setenv(malloc_bound.MALLOC_THRESHOLD_ENV, "off")
    assert malloc_bound.configured_threshold() == 0
    monkeypatch.setenv(malloc_bound.MALLOC_THRESHOLD_ENV, "4194304")
    assert malloc_bound.configured_threshold() == 4 << 20
    monkeypatch.setenv(malloc_bound.MALLOC_THRESHOLD_ENV, "lots")
    with pytest.raises(ValueError, match="SHARDKIT_MALLOC_THRESHOLD='lots'"):
        malloc_bound.configured_threshold()
