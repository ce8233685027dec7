"""step_waits' timers: they count and time the collectives and leave their results unchanged."""

import pytest
import torch
import torch.distributed as dist

from benchmarks import step_waits


def _exchange_twice(steps: int):
    step_waits.install_timers()
    try:
        return _exchange(steps)
    finally:
        step_waits.uninstall_timers()  # the pool's workers run other tests next


def _exchange(steps: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    got = []
    for _ in range(steps):
        send = torch.arange(4 * world, dtype=torch.float32) + 100 * rank
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, async_op=True)  # torch's function: the group's method
        work.wait()
        got.append(recv.clone())
        flat = torch.empty(2 * world)
        dist.all_to_all_single(flat, torch.full((2 * world,), float(rank)))  # synchronous
        got.append(flat)
    return got, step_waits.summarize(1.0, 0.5, 0.6, steps)


def test_timed_collectives_give_the_same_results_and_count_every_exchange(run_world):
    for rank, (got, summary) in enumerate(run_world(_exchange_twice, 2, 3)):
        for i in range(0, len(got), 2):
            expected = torch.cat(
                [torch.arange(4 * r, 4 * r + 4.0) + 100 * s for s, r in [(0, rank), (1, rank)]]
            )
            assert torch.equal(got[i], expected)
            assert torch.equal(got[i + 1], torch.tensor([0.0, 0.0, 1.0, 1.0]))
        assert summary["colls"] == 2 and summary["MB"] == pytest.approx((32 + 16) / 1e6)
        # two exchanges a step, each averaged over the 3 steps; blocked time is wall minus CPU
        assert [mb for mb, _ in summary["waits"]] == pytest.approx([32 / 1e6, 16 / 1e6])
        assert summary["wall"] == pytest.approx(1e3 / 3) and summary["main_cpu"] == pytest.approx(500 / 3)
        assert summary["rest"] == pytest.approx(summary["wall"] - summary["main_cpu"] - summary["blocked"])


def _restored():
    original = vars(dist.ProcessGroup)["all_to_all_single"]
    step_waits.install_timers()
    wrapped = dist.ProcessGroup.all_to_all_single
    step_waits.uninstall_timers()
    # the group's method must still bind the group: a call through it works after the timers are gone
    world = dist.get_world_size()
    recv = torch.empty(world)
    opts = dist.AllToAllOptions()
    dist.group.WORLD.all_to_all_single(recv, torch.full((world,), 1.0), [1] * world, [1] * world, opts).wait()
    restored = vars(dist.ProcessGroup)["all_to_all_single"] is original
    return wrapped is not original and restored and torch.equal(recv, torch.ones(world))


def test_uninstall_puts_the_group_method_back(run_world):
    assert run_world(_restored, 2) == [True, True]
