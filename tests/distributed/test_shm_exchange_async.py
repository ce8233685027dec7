"""The shared-memory exchange without gloo in its path: calls in flight completed in any order, more of
them than buffers, bounded waits naming the silent rank, a rank without space sending everyone to
gloo, size disagreements, the all-reduce, and no file left behind."""

from __future__ import annotations

import glob
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed import shm_control, shm_exchange
from shardkit.distributed.direct_collectives import all_to_all_single
from shardkit.distributed.timeouts import CollectiveTimeoutError
from shardkit.testing import run_world

FILES = "/dev/shm/shardkit-x-*"


def _prefixes() -> list:
    """The file prefixes of this process's exchanges (the files of this test, whatever else runs)."""
    return [e.prefix for e in shm_exchange._EXCHANGES.values() if e is not None]


def _left_behind(prefixes: list) -> list:
    return [path for prefix in prefixes for path in glob.glob(prefix + "-*")]


def _sends(world: int, count: int, scale: int, seed: int = 3):
    """``count`` exchanges' (send, send splits, recv splits) on this rank, the same draws on every rank."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        splits = torch.randint(0, 4, (world, world), generator=gen) * (scale if i % 3 else 1)
        send_splits, recv_splits = splits[rank].tolist(), splits[:, rank].tolist()
        send = torch.randn(sum(send_splits)) + 1000 * rank + i  # not from ``gen``: its size is per rank
        out.append((send, send_splits, recv_splits))
    return out


def _reference(sends):
    refs = []
    for send, send_splits, recv_splits in sends:
        ref = torch.empty(sum(recv_splits))
        dist.all_to_all_single(ref, send, recv_splits, send_splits)
        refs.append(ref)
    return refs


def _in_flight(order: str, scale: int, futex: bool = True) -> list:
    if not futex:  # the waits' fallback where futex cannot be called: sleeps
        saved, shm_control._futex = shm_control._futex, None
        try:
            return _in_flight(order, scale)
        finally:
            shm_control._futex = saved
    world = dist.get_world_size()
    sends = _sends(world, 3 * shm_exchange.BUFFERS + 2, scale)
    refs = _reference(sends)
    outs = [torch.full((sum(r),), float("nan")) for _, _, r in sends]
    shm_exchange.set_shm_exchange(True)
    try:

        def start(i):
            send, send_splits, recv_splits = sends[i]
            return all_to_all_single(outs[i], send, recv_splits, send_splits, dist.group.WORLD, async_op=True)

        n = len(sends)
        if order == "pipeline":  # start n+1 before waiting n
            works = [start(0)]
            for i in range(1, n):
                works.append(start(i))
                works[i - 1].wait()
            works[-1].wait()
        elif order == "more_than_buffers":  # every call started, then waited last to first
            works = [start(i) for i in range(n)]
            for work in reversed(works):
                assert work.wait()
        else:  # waited every other, the rest never waited by the caller until the end
            works = [start(i) for i in range(n)]
            for work in works[1::2]:
                work.wait()
            for work in works:
                work.wait()
        assert all(work.is_completed() for work in works)
        exchange = shm_exchange.exchange_for(dist.group.WORLD)
        calls = exchange._calls
        prefixes = _prefixes()
    finally:
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()
    dist.barrier()  # every rank closed: none of the test's files is left
    same = [torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(outs, refs)]
    return [calls, same, _left_behind(prefixes)]


@pytest.mark.parametrize("order", ["pipeline", "more_than_buffers", "every_other"])
def test_calls_in_flight_complete_in_any_order_with_gloos_bytes(order):
    for calls, same, left in run_world(_in_flight, 3, order, 40_000):  # past the 128 KiB one-piece copy
        assert calls == 3 * shm_exchange.BUFFERS + 2 and all(same) and left == [], (same, left)


def test_without_futex_the_waits_sleep_and_give_the_same_bytes():
    for _, same, _ in run_world(_in_flight, 2, "pipeline", 40_000, False):
        assert all(same), same


def _skips(skipper: int, timeout_s: float) -> dict:
    rank = dist.get_rank()
    group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=timeout_s))
    shm_exchange.set_shm_exchange(True)
    send = torch.arange(dist.get_world_size() * 4, dtype=torch.float32)
    out = torch.empty_like(send)
    try:
        all_to_all_single(out, send, [], [], group, async_op=False)  # set up, one call on every rank
        prefix = shm_exchange.exchange_for(group).prefix  # its files: gone once the world is done
        if rank == skipper:  # stalls (and then leaves: the others must have given up by then)
            time.sleep(timeout_s + 2.0)
            return {"skipped": True, "prefix": prefix}
        start = time.monotonic()
        try:
            all_to_all_single(out, send, [], [], group, async_op=False)
        except CollectiveTimeoutError as err:
            return {"error": str(err), "after_s": time.monotonic() - start, "prefix": prefix}
        return {"error": None, "prefix": prefix}
    finally:
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()


def test_a_rank_that_skips_an_exchange_is_named_by_the_others_within_the_timeout():
    got = run_world(_skips, 3, 1, 3.0)
    assert got[1]["skipped"] is True
    for rank in (0, 2):
        message = got[rank]["error"]
        assert message is not None, got
        assert "rank(s) [1 (global 1)] did not publish call 1" in message, message
        assert "group of 3" in message and "of call 1" in message, message
        assert got[rank]["after_s"] < 3.0 + 2.0, got[rank]
    _assert_files_removed(got)


def _no_space_on(rank_without: int, limit: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == rank_without:
        real = shm_control.reserve

        def reserve(fd, nbytes):
            if nbytes > limit:
                raise OSError(28, "No space left on device (test)")
            real(fd, nbytes)

        shm_control.reserve = reserve
    try:
        sends = _sends(world, 8, 100_000, seed=5)  # calls 1, 2, 4, 5, 7: 100_000x larger
        refs = _reference(sends)
        shm_exchange.set_shm_exchange(True)
        outs, gloo_only = [], []
        for send, send_splits, recv_splits in sends:
            out = torch.empty(sum(recv_splits))
            all_to_all_single(out, send, recv_splits, send_splits, dist.group.WORLD, async_op=False)
            outs.append(out)
            gloo_only.append(shm_exchange.exchange_for(dist.group.WORLD)._gloo_only)
        prefixes = _prefixes()
    finally:
        shm_control.reserve = real if rank == rank_without else shm_control.reserve
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()
    dist.barrier()  # every rank closed: none of the test's files is left
    return {
        "same": [torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(outs, refs)],
        "gloo_only": gloo_only,
        "left": _left_behind(prefixes),
    }


def test_a_rank_without_space_sends_that_call_and_the_later_ones_through_gloo_on_every_rank():
    got = run_world(_no_space_on, 3, 2, 1 << 20)
    for result in got:
        assert all(result["same"]) and result["left"] == [], result
        # call 0 (small) fits; call 1 (MiBs) does not on rank 2: from there on gloo, on every rank
        assert result["gloo_only"] == [False] + [True] * 7, result


def _filled_sums_without_space(rank_without: int, limit: int) -> dict:
    """All-reduces whose terms ``fill`` makes, on a group where one rank cannot reserve more than
    ``limit`` bytes: a small call through shared memory, then a large one (the others' terms already
    in their shared buffers) and a later one through gloo. Integer-valued terms: every order sums
    them exactly, so each result is compared with the plain sum."""
    rank, world = dist.get_rank(), dist.get_world_size()
    real = shm_control.reserve
    if rank == rank_without:

        def reserve(fd, nbytes):
            if nbytes > limit:
                raise OSError(28, "No space left on device (test)")
            real(fd, nbytes)

        shm_control.reserve = reserve
    shm_exchange.set_shm_exchange(True)
    try:
        exchange = shm_exchange.exchange_for(dist.group.WORLD)
        same, gloo_only = [], []
        for n in (100, 1 << 20, 1000):
            terms = [torch.arange(n, dtype=torch.float32) % 97 + r for r in range(world)]
            got = torch.full((n,), float("nan"))
            exchange.all_reduce_sum(got, lambda out, term=terms[rank]: out.copy_(term)).wait()
            same.append(torch.equal(got, sum(terms)))
            gloo_only.append(exchange._gloo_only)
        return {"same": same, "gloo_only": gloo_only, "prefix": exchange.prefix}
    finally:
        shm_control.reserve = real
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()


def test_an_all_reduce_whose_terms_are_made_in_shared_buffers_falls_back_to_gloo_whole():
    got = run_world(_filled_sums_without_space, 3, 2, 1 << 20)
    for result in got:
        assert (result["same"], result["gloo_only"]) == ([True] * 3, [False, True, True]), result
    _assert_files_removed(got)


def _assert_files_removed(got: list) -> None:
    """Every rank used one exchange, and none of its files is left (its own prefix only: another
    test's world may run beside this one, its files in the same directory)."""
    prefixes = {g["prefix"] for g in got}
    assert len(prefixes) == 1 and next(iter(prefixes)).startswith(FILES[:-1]), prefixes
    assert glob.glob(next(iter(prefixes)) + "*") == []


def _disagree() -> str:
    rank = dist.get_rank()
    shm_exchange.set_shm_exchange(True)
    try:
        send = torch.zeros(8)
        recv_splits = [4, 4] if rank == 0 else [4, 3]  # rank 1 expects 3 elements from itself
        out = torch.empty(sum(recv_splits))
        try:
            all_to_all_single(out, send, recv_splits, [4, 4], dist.group.WORLD, async_op=False)
        except ValueError as err:
            return str(err)
        return ""
    finally:
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()


def test_a_size_disagreement_is_an_error_on_every_rank_naming_it():
    for message in run_world(_disagree, 2):
        assert "rank 1 sends 16 bytes to rank 1, which expects 12" in message, message


def _all_reduce(world: int) -> list:
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    values = [torch.randn(n, generator=gen) * 1e3 for n in (1, 7, 30_000, 300_000)]
    gathered = []
    for v in values:
        parts = [torch.empty_like(v) for _ in range(world)]
        dist.all_gather(parts, v)
        expect = parts[0].clone()
        for p in parts[1:]:
            expect += p
        gathered.append(expect)
    shm_exchange.set_shm_exchange(True)
    try:
        exchange = shm_exchange.exchange_for(dist.group.WORLD)
        works = [exchange.all_reduce_sum(v) for v in values]
        for work in works[::-1]:
            work.wait()
        return [torch.equal(v, e) for v, e in zip(values, gathered)] + [values[2][:5].tolist()]
    finally:
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()


def test_the_all_reduce_sums_in_rank_order_the_same_bits_on_every_rank():
    got = run_world(_all_reduce, 3, 3)
    for result in got:
        assert all(result[:-1]), result
    assert got[0][-1] == got[1][-1] == got[2][-1]


def _weakly_ordered() -> int:
    shm_control.STRONGLY_ORDERED = False
    shm_exchange.set_shm_exchange(True)
    try:
        send = torch.arange(4.0)
        out = torch.empty(4)
        all_to_all_single(out, send, [], [], dist.group.WORLD, async_op=False)
        return shm_exchange.exchange_for(dist.group.WORLD) is None
    finally:
        shm_control.STRONGLY_ORDERED = True
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()


def test_a_cpu_without_strong_ordering_keeps_gloo():
    assert run_world(_weakly_ordered, 2) == [True, True]
