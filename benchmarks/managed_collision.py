"""Managed collision: remap throughput against the floor (a plain ``torch.searchsorted`` over the same
sorted slot map), the cost of profiling with an eviction every step, and an MC-EBC training step
against the plain EmbeddingBagCollection step on the same (already in-range) ids.

Run from the repository root: ``python -m benchmarks.managed_collision [--slots 100000 10000000]``.
Validation (one host sync per call for the id range check) is off while timing. Every ratio compares
timings taken in the same run on the same data.
"""

from __future__ import annotations

import argparse
from typing import List

import torch

from benchmarks.common import median_seconds, write_results
from shardkit.distributed.validation import set_validation
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedOptimizerConfig,
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
    OptimType,
)
from shardkit.sparse import KeyedJaggedTensor

HASH_SIZE = 2**63 - 1


def full_module(slots: int, buckets: int, gen: torch.Generator) -> MCHManagedCollisionModule:
    """A module whose every slot (but the miss slots) holds a random id, as after a long warm-up."""
    module = MCHManagedCollisionModule(slots, None, LFU_EvictionPolicy(), 1, HASH_SIZE, buckets=buckets)
    size, id_range = slots // buckets, -(-HASH_SIZE // buckets)
    with torch.no_grad():
        for b in range(buckets):
            # collisions of 63-bit draws are negligible; unique keeps the map valid anyway
            ids = torch.unique(b * id_range + torch.randint(0, id_range - 1, (size - 1,), generator=gen))
            module._mch_sorted_raw_ids[b * size : b * size + ids.numel()] = ids
    module.validate_state()
    return module


def queries(module: MCHManagedCollisionModule, n: int, hit_rate: float, gen: torch.Generator) -> torch.Tensor:
    held = module._mch_sorted_raw_ids[module._mch_sorted_raw_ids != torch.iinfo(torch.int64).max]
    hits = held[torch.randint(0, held.numel(), (n,), generator=gen)]
    misses = torch.randint(0, 2**62, (n,), generator=gen)
    return torch.where(torch.rand(n, generator=gen) < hit_rate, hits, misses)


def remap_rows(slots_list: List[int], batch: int, repeats: int) -> List[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for slots in slots_list:
        for buckets in (1, 4):
            module = full_module(slots, buckets, gen)
            ids = queries(module, batch, 0.8, gen)
            floor = median_seconds(
                lambda m=module, q=ids: torch.searchsorted(m._mch_sorted_raw_ids, q), repeats
            )
            remap = median_seconds(lambda m=module, q=ids: m.remap_ids(q), repeats)
            module.train()
            profile = median_seconds(lambda m=module, q=ids: m.profile_ids(q), max(1, repeats // 2))
            rows.append(
                {
                    "name": f"remap slots={slots} buckets={buckets}",
                    "ids": batch,
                    "remap_ids_per_s": batch / remap,
                    "searchsorted_ids_per_s": batch / floor,
                    "remap_vs_searchsorted": remap / floor,
                    "profile_evict_ids_per_s": batch / profile,
                }
            )
    return rows


def step_rows(rows_per_table: int, dim: int, batch: int, pooling: int, repeats: int) -> List[dict]:
    """The MC-EBC step vs the EBC step; raw ids drawn from a pool of half the slots (all held after
    the first step) or of twice the slots (new ids and evictions every step)."""
    gen = torch.Generator().manual_seed(1)
    tables = [EmbeddingBagConfig(rows_per_table, dim, name="t", feature_names=["f"])]
    optimizer = FusedOptimizerConfig(OptimType.ROWWISE_ADAGRAD, lr=0.01)
    ebc = EmbeddingBagCollection(tables, fused_optimizer=optimizer)
    lengths = torch.full((batch,), pooling)
    out = []
    for pool_size, what in ((rows_per_table // 2, "ids held"), (2 * rows_per_table, "evicting")):
        mc = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables, fused_optimizer=optimizer),
            ManagedCollisionCollection(
                {"t": MCHManagedCollisionModule(rows_per_table, None, LFU_EvictionPolicy(), 1, HASH_SIZE)},
                tables,
            ),
        )
        pool = torch.randint(0, 2**62, (pool_size,), generator=gen)
        steps = [
            pool[torch.randint(0, pool_size, (batch * pooling,), generator=gen)] for _ in range(repeats + 2)
        ]
        for raw in steps[:2]:  # warm-up: the pool's ids take their slots
            mc(KeyedJaggedTensor(["f"], raw, lengths=lengths))[0].values().sum().backward()
        raw_kjts = iter([KeyedJaggedTensor(["f"], raw, lengths=lengths) for raw in steps[1:]])
        plain_kjt = KeyedJaggedTensor(["f"], torch.remainder(steps[0], rows_per_table), lengths=lengths)

        def mc_step(kjts=raw_kjts, module=mc):
            module(next(kjts))[0].values().sum().backward()

        def plain_step(kjt=plain_kjt):
            ebc(kjt).values().sum().backward()

        mc_time = median_seconds(mc_step, repeats)  # warm-up + repeats calls: one batch each
        plain_time = median_seconds(plain_step, repeats)
        out.append(
            {
                "name": f"step rows={rows_per_table} dim={dim} batch={batch} pooling={pooling} ({what})",
                "mc_ebc_ms": mc_time * 1e3,
                "ebc_ms": plain_time * 1e3,
                "mc_ebc_vs_ebc": mc_time / plain_time,
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--slots", type=int, nargs="+", default=[100_000, 10_000_000])
    parser.add_argument("--batch", type=int, default=1_000_000, help="ids per remap call")
    parser.add_argument("--rows", type=int, default=100_000, help="table rows of the training step")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--step-batch", type=int, default=2048)
    parser.add_argument("--pooling", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    set_validation(False)
    rows = remap_rows(args.slots, args.batch, args.repeats)
    rows += step_rows(args.rows, args.dim, args.step_batch, args.pooling, args.repeats)
    write_results("managed_collision", vars(args), rows, args.out)


if __name__ == "__main__":
    main()
