"""Proposer: which option of each table to try together.

A table's cheapest option in total time (usually TABLE_WISE: least communication) is not always the
best one: a table whose single shard takes longer than a perfectly balanced rank would bounds the step
time however the others are placed, and a table whose shard does not fit a rank's memory cannot be
placed at all. The proposer therefore offers a family of proposals, each picking per table the
cheapest option whose largest shard stays under a time threshold (``alpha`` x the perfect per-rank
time) and a memory threshold (``beta`` x a rank's free memory), for a ladder of thresholds from
"anything" to "very fine-grained", and one proposal per sharding type every table allows (all tables
of that type: a plan pays a fixed cost per type it uses, which no per-table choice sees); the planner
partitions each and keeps the best. It then refines
the best by feedback (:meth:`GreedyThresholdProposer.refine`): the table that weighs most on the
slowest rank gets a finer option; the change is kept when it makes the plan faster.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Set

from shardkit.planner.partitioners import Partition
from shardkit.planner.types import ShardingOption

ALPHAS = (float("inf"), 4.0, 2.0, 1.0, 0.5, 0.25, 0.125)
BETAS = (1.0, 0.25)


class GreedyThresholdProposer:
    """Yields proposals (one option per table, in table order), without duplicates.

    Args:
        alphas: thresholds on a table's largest shard time, relative to the perfect per-rank time
            (sum over tables of their cheapest option's total time / world size).
        betas: thresholds on a table's largest shard memory, relative to the least free memory of
            any rank (HBM and DDR separately).
    """

    def __init__(self, alphas: Sequence[float] = ALPHAS, betas: Sequence[float] = BETAS) -> None:
        self.alphas = tuple(alphas)
        self.betas = tuple(betas)

    def propose(
        self,
        options: Sequence[Sequence[ShardingOption]],
        world_size: int,
        hbm_free: Sequence[float],
        ddr_free: Sequence[float],
    ) -> Iterator[List[ShardingOption]]:
        # per table: options sorted by total time, cheapest first
        ranked = [sorted(opts, key=lambda o: (o.total_perf, o.max_storage)) for opts in options]
        ideal = sum(opts[0].total_perf for opts in ranked) / world_size
        hbm_cap, ddr_cap = min(hbm_free), min(ddr_free)
        seen = set()
        for beta in self.betas:
            for alpha in self.alphas:
                proposal = [
                    self._pick(opts, alpha * ideal, beta * hbm_cap, beta * ddr_cap) for opts in ranked
                ]
                key = tuple(map(id, proposal))
                if key not in seen:
                    seen.add(key)
                    yield proposal
        # every table one sharding type (each type all tables offer): a plan pays a fixed cost per
        # sharding type it uses (CostModel.group_overhead_s), which per-table choices cannot see
        common = (
            set.intersection(*(set(o.sharding_type for o in opts) for opts in ranked)) if ranked else set()
        )
        for sharding_type in sorted(common):
            proposal = [
                self._pick(
                    [o for o in opts if o.sharding_type == sharding_type], float("inf"), hbm_cap, ddr_cap
                )
                for opts in ranked
            ]
            key = tuple(map(id, proposal))
            if key not in seen:
                seen.add(key)
                yield proposal
        # last resort for memory: each table's smallest-footprint option
        proposal = [min(opts, key=lambda o: (o.max_storage, o.total_perf)) for opts in ranked]
        if tuple(map(id, proposal)) not in seen:
            yield proposal

    @staticmethod
    def refine(
        options: Sequence[Sequence[ShardingOption]],
        proposal: Sequence[ShardingOption],
        partition: Partition,
        tried: Set[int],
    ) -> Optional[List[ShardingOption]]:
        """The next proposal to try after ``proposal`` partitioned into ``partition``, or None.

        Feedback step: the table that weighs most on the slowest rank is switched to its cheapest
        option whose largest shard is smaller than what the table costs that rank now (a finer split
        the partitioner can spread). Options whose ``id`` is in ``tried`` (switches that did not
        pay off) are skipped, so the next table on the slowest rank gets its turn. None when no
        table on the slowest rank has an untried finer option.
        """
        slowest = max(range(len(partition.load)), key=partition.load.__getitem__)
        on_slowest = []
        for i, placed in enumerate(partition.options):
            share = sum(p for p, r in zip(placed.perf.tolist(), placed.ranks.tolist()) if r == slowest)
            if share > 0:
                on_slowest.append((share, i))
        for share, i in sorted(on_slowest, reverse=True):
            finer = [
                o for o in options[i] if o.max_perf < share and o is not proposal[i] and id(o) not in tried
            ]
            if finer:
                changed = list(proposal)
                changed[i] = min(finer, key=lambda o: (o.total_perf, o.max_perf))
                return changed
        return None

    @staticmethod
    def _pick(
        opts: Sequence[ShardingOption], max_perf: float, max_hbm: float, max_ddr: float
    ) -> ShardingOption:
        fits_memory = [o for o in opts if o.max_hbm <= max_hbm and o.max_ddr <= max_ddr] or list(opts)
        for o in fits_memory:
            if o.max_perf <= max_perf:
                return o
        return min(fits_memory, key=lambda o: (o.max_perf, o.total_perf))


__all__ = ["ALPHAS", "BETAS", "GreedyThresholdProposer"]
