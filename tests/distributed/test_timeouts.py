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
    is_peer_closed,
    is_timeout,
    naming_silent_ranks,
    parse_timeout,
    timeout_from_env,
)

# imported here, not in the workers' functions: the harness imports a test module while it unpickles
# the task, before the rendezvous, so a rank slow to import cannot use up the 2 s collective timeout
# of the sharding set-up below (issue 23, flaky tests)
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import (
    construct_module_sharding_plan,
    grid_shard,
    table_column_wise,
    table_row_wise,
)
from shardkit.sharding.types import ShardingEnv
from shardkit.sparse import KeyedJaggedTensor
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


def _rank_0_comes_after_rank_1_timed_out() -> None:
    """Rank 2 silent; rank 0 enters the all-reduce only once rank 1's wait has timed out (rank 1 is in
    its roll call): gloo has closed rank 1's connections, so rank 0 never sees a timeout of its own,
    only "Connection closed by peer" (what a survivor late by a moment got under load)."""
    if dist.get_rank() == 2:
        time.sleep(20)
        return
    if dist.get_rank() == 0:
        store = dist.distributed_c10d._get_default_store()
        while store.add("shardkit/roll_call/1", 0) < 1:  # rank 1's answer to its roll call
            time.sleep(0.05)
    start = time.monotonic()
    try:
        with naming_silent_ranks(grace_s=3):
            dist.all_reduce(torch.ones(1))
    except CollectiveTimeoutError as err:
        raise CollectiveTimeoutError(f"after {time.monotonic() - start:.1f} s: {err}") from None


def test_a_survivor_cut_off_by_a_peers_timeout_still_names_the_silent_rank():
    with pytest.raises(WorldError) as info:
        run_world(
            _rank_0_comes_after_rank_1_timed_out,
            3,
            timeout=60,
            env={"SHARDKIT_TIMEOUT": str(COLLECTIVE_TIMEOUT_S)},
        )
    report = str(info.value)
    cut_off = re.findall(
        r"CollectiveTimeoutError: after ([\d.]+) s: rank 0: a collective was cut off by a peer closing its "
        r"connections \(rank\(s\) \[2\] did not answer\)",
        report,
    )
    assert len(cut_off) == 1 and float(cut_off[0]) < 3 + 10, report
    assert "Connection closed by peer" in report  # what torch said, kept in the message
    assert re.search(r"rank 1: a collective timed out \(rank\(s\) \[2\] did not answer\)", report), report


def _rank_1_fails_on_its_own() -> None:
    """Rank 1 raises a bug of its own while rank 0 waits in an all-reduce that rank 2 (silent) never
    joins: rank 1's closed connections cut rank 0 off."""
    if dist.get_rank() == 2:
        time.sleep(20)
        return
    if dist.get_rank() == 1:
        raise ValueError("rank 1's own bug")
    dist.all_reduce(torch.ones(1))


def test_a_survivor_cut_off_by_a_peer_that_failed_on_its_own_does_not_name_it():
    # the harness marks rank 1 as leaving with its own error: rank 0 neither waits out a roll call for
    # it nor names it silent (it would have been "rank(s) [1, 2] did not answer", after 5 s)
    # (rank 0's group timeout, 30 s, is longer than the harness gives it after rank 1's failure: it
    # reports gloo's error of the closed connection, or it is killed)
    with pytest.raises(WorldError) as info:
        run_world(_rank_1_fails_on_its_own, 3, timeout=60, env={"SHARDKIT_TIMEOUT": "30"})
    report = str(info.value)
    sections = dict(re.findall(r"--- rank (\d) ---\n(.*?)(?=\n--- rank \d ---|\Z)", report, re.S))
    assert "ValueError: rank 1's own bug" in sections["1"], report
    closed = r"RuntimeError: .*(Connection closed by peer|Connection reset by peer|Broken pipe|Socket)"
    assert re.search(closed, sections["0"]) and "did not answer" not in sections["0"], report
    assert "worker killed" in sections["2"], report


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
    closed = "[pair.cc:553] Connection closed by peer [127.0.0.1]:53960. This is typically caused by"
    assert is_peer_closed(RuntimeError(closed)) and not is_timeout(RuntimeError(closed))
    assert not is_peer_closed(RuntimeError("Gloo connectFullMesh failed with " + closed))  # set-up
    assert not is_peer_closed(ValueError("size mismatch")) and not is_peer_closed(
        CollectiveTimeoutError(closed)
    )


def _stall_in_backward(sharding: str) -> None:
    """A table sharded over the node groups; every rank runs the forward, rank 3 then goes silent
    instead of running the backward, whose collectives run on the node groups."""
    generator = {
        "table_row_wise": table_row_wise(host_index=1),
        "table_column_wise": table_column_wise(host_index=1),
        "grid_shard": grid_shard(host_indexes=[0, 1]),
    }[sharding]
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(8, 8, name="t", feature_names=["f"])], fused_optimizer=FusedOptimizerConfig("SGD")
    )
    plan = construct_module_sharding_plan(ebc, {"t": generator})
    sharded = EmbeddingBagCollectionSharder().shard(ebc, plan, ShardingEnv.from_process_group(None))
    kjt = KeyedJaggedTensor(["f"], torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
    loss = sharded(kjt).values().sum()
    if dist.get_rank() == 3:
        time.sleep(40)  # silent: killed by the harness once the others have failed
        return
    start = time.monotonic()
    try:
        with naming_silent_ranks(grace_s=3):
            loss.backward()
    except CollectiveTimeoutError as err:
        raise CollectiveTimeoutError(f"after {time.monotonic() - start:.1f} s: {err}") from None


# table-column-wise and grid tables use the same node groups (each case costs a world-4 launch and a
# killed worker; test_groups_shardkit_makes_take_the_default_groups_timeout checks the groups directly)
@pytest.mark.parametrize("sharding", ["table_row_wise"])
def test_a_stall_in_the_backward_of_node_group_tables_ends_within_the_timeout(sharding):
    # issue 23: the node groups were made without a timeout and kept torch's 30 minutes
    with pytest.raises(WorldError) as info:
        run_world(
            _stall_in_backward,
            4,
            sharding,
            timeout=60,
            local_world_size=2,
            env={"SHARDKIT_TIMEOUT": str(COLLECTIVE_TIMEOUT_S)},
        )
    report = str(info.value)
    # the ranks waiting in the backward's node-group collectives fail naming rank 3 (a rank whose
    # backward needed nothing of rank 3 times out in the harness's closing barrier instead, or is cut
    # off there when a peer that timed out first closes its connections: named by the harness)
    # timeouts are named by the roll call ("rank(s) [1, 3] did not answer"), the shared-memory
    # exchange's too (the default; CPU node groups of one host): its own naming, of the group's peer
    # it waited for ("rank(s) [1 (global 1)] did not publish call 1"), may name a rank that was itself
    # waiting for rank 3, so naming_silent_ranks runs the roll call on it as on gloo's timeouts
    silent_ranks = r"rank\(s\) \[([\d, ()global]*)\] did not (?:answer|publish)"
    # non-greedy: the first naming on the line (the roll call's), not one quoted from the cause
    survivors = re.findall(r"CollectiveTimeoutError: after ([\d.]+) s: .*?" + silent_ranks, report)
    assert survivors and all("3" in _global_ranks(silent) for _, silent in survivors), report
    assert all(float(elapsed) < COLLECTIVE_TIMEOUT_S + 3 + 10 for elapsed, _ in survivors), survivors
    sections = dict(re.findall(r"--- rank (\d) ---\n(.*?)(?=\n--- rank \d ---|\Z)", report, re.S))
    named = r"CollectiveTimeoutError: (after [\d.]+ s: )?.*?" + silent_ranks
    for rank in "012":  # each failed naming rank 3, none waited until the harness killed it
        assert rank in sections and "worker killed" not in sections[rank], report
        silent = [m.group(2) for m in re.finditer(named, sections[rank])]
        assert silent and all("3" in _global_ranks(s) for s in silent), report


def _global_ranks(listed: str) -> list:
    """``"1, 3"`` -> ["1", "3"]; ``"1 (global 3)"`` -> ["3"]."""
    return [m.group(2) or m.group(1) for m in re.finditer(r"(\d+)(?: \(global (\d+)\))?", listed)]


def test_groups_shardkit_makes_take_the_default_groups_timeout():
    timeouts = run_world(_grid_timeouts, 2, env={"SHARDKIT_TIMEOUT": "7"})
    assert timeouts == [[7.0, 7.0, 7.0]] * 2


def _grid_timeouts():
    from shardkit.distributed.grid import ParallelGrid
    from shardkit.distributed.timeouts import process_group_timeout

    grid = ParallelGrid.create(1)
    return [process_group_timeout(g).total_seconds() for g in (None, grid.mp_group, grid.dp_group)]
