"""A rank that goes silent: the others fail within SHARDKIT_TIMEOUT, naming it."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed.timeouts import (
    CollectiveTimeoutError,
    is_timeout,
    naming_silent_ranks,
    parse_timeout,
    timeout_from_env,
)
from shardkit.testing import run_world
from shardkit.testing.harness import WorldError

COLLECTIVE_TIMEOUT_S = 2


def _one_rank_stalls() -> None:
    if dist.get_rank() == 2:
        time.sleep(20)  # silent: never reaches the collective (killed by the harness before it wakes)
        return
    start = time.monotonic()
    try:
        with naming_silent_ranks(grace_s=3):
            dist.all_reduce(torch.ones(1))
    except CollectiveTimeoutError as err:
        raise CollectiveTimeoutError(f"after {time.monotonic() - start:.1f} s: {err}") from None


def test_survivors_fail_within_the_timeout_naming_the_silent_rank():
    with pytest.raises(WorldError) as info:
        run_world(_one_rank_stalls, 3, timeout=60, env={"SHARDKIT_TIMEOUT": str(COLLECTIVE_TIMEOUT_S)})
    report = str(info.value)
    survivors = re.findall(
        r"CollectiveTimeoutError: after ([\d.]+) s: rank (\d): .*rank\(s\) \[2\] did not answer", report
    )
    assert sorted(rank for _, rank in survivors) == ["0", "1"], report
    # the group's timeout plus the roll call's grace, far below torch's 30-minute default
    assert all(float(elapsed) < COLLECTIVE_TIMEOUT_S + 3 + 10 for elapsed, _ in survivors), survivors


def test_timeout_settings(monkeypatch):
    monkeypatch.setenv("SHARDKIT_TIMEOUT", "7.5")
    assert timeout_from_env(timedelta(seconds=1)) == timedelta(seconds=7.5)
    monkeypatch.delenv("SHARDKIT_TIMEOUT")
    assert timeout_from_env(timedelta(seconds=1)) == timedelta(seconds=1)
    for bad in ("soon", "0", "-3", "inf", "nan"):
        with pytest.raises(ValueError, match="--timeout must be a"):
            parse_timeout(bad, "--timeout")
    assert is_timeout(RuntimeError("[gloo] Timed out waiting 2000ms for recv operation to complete"))
    assert not is_timeout(RuntimeError("size mismatch"))
