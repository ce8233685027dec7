"""``shardkit demo --quantize``: the trained DLRM served with int8 and int4 tables, sharded.

After the demo's training and exactness check, the trained model's tables are quantized
(``QuantEmbeddingBagCollection.from_float``), planned by the planner with their stored sizes, and
served sharded on the demo's ranks (``QuantEmbeddingBagCollectionSharder``). On held-out batches (the
steps after training) the demo prints each rank's table memory against fp32 and how far the predicted
click rates move from the fp32 model's (mean abs difference, AUC against the labels), and checks that
the sharded quantized model predicts what the unsharded quantized model predicts.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

from shardkit.datasets import SyntheticClicks
from shardkit.modules import DataType
from shardkit.quant import QuantEmbeddingBagCollection

HELD_OUT = 4  # held-out batches per rank
DATA_TYPES = (DataType.INT8, DataType.INT4)
MIB = float(1 << 20)


def predicted_ctr(model: torch.nn.Module, batch) -> torch.Tensor:
    """fp32 ``[B]`` click probabilities of ``model`` (a MixedDimDLRM, its tables sharded or not)."""
    captured: List[torch.Tensor] = []
    handle = model.over_arch.register_forward_hook(lambda module, args, out: captured.append(out))
    try:
        with torch.no_grad():
            model(batch)
    finally:
        handle.remove()
    return torch.sigmoid(captured[0].squeeze(1).float())


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (the probability that a random click outscores a random non-click)."""
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    positives = labels.bool()
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _plans(model, tables, args) -> Dict[DataType, object]:
    from shardkit.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from shardkit.sharding.quant_embeddingbag import QuantEmbeddingBagCollectionSharder

    plans = {}
    for data_type in DATA_TYPES:
        quantized = QuantEmbeddingBagCollection.from_float(model.ebc, data_type=data_type)
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=args.nproc, compute_device="cpu"),
            batch_size=args.batch_size,
            constraints={t.name: ParameterConstraints(pooling_factors=[t.pooling]) for t in tables},
        )
        plans[data_type] = planner.plan(
            quantized, [QuantEmbeddingBagCollectionSharder()]
        ).get_plan_for_module("")
    return plans


def serve_rank(model, plans, tables, batch_size: int, first_step: int, seed: int) -> dict:
    """One rank: each data type's sharded quantized model on this rank's held-out batches."""
    from shardkit.distributed.sharding_env import ShardingEnv
    from shardkit.sharding.quant_embeddingbag import QuantEmbeddingBagCollectionSharder

    rank = dist.get_rank()
    data = SyntheticClicks(tables, batch_size, model.dense_arch[0].in_features, seed)
    batches = [data.batch(first_step + k, rank) for k in range(HELD_OUT)]
    out = {}
    for data_type, plan in plans.items():
        quantized = QuantEmbeddingBagCollection.from_float(model.ebc, data_type=data_type)
        served = copy.deepcopy(model)
        served.ebc = QuantEmbeddingBagCollectionSharder().shard(
            quantized, plan, ShardingEnv.from_process_group(None)
        )
        shards = served.ebc.local_shards()
        out[data_type.value] = {
            "ctr": torch.cat([predicted_ctr(served, b) for b in batches]),
            "bytes": sum(s.numel() * s.element_size() for s in shards.values()),
            "fp32_bytes": sum((r1 - r0) * (c1 - c0) * 4 for _, r0, r1, c0, c1 in shards),
        }
    return out


def run(model, tables: Sequence, args, tolerance: float) -> bool:
    """Quantize the trained ``model``, serve it on ``args.nproc`` ranks, print the comparison; True if
    the sharded quantized predictions equal the unsharded quantized ones within ``tolerance``."""
    from shardkit.testing import run_world

    first_step = args.steps  # batches no training step saw
    data = SyntheticClicks(tables, args.batch_size, model.dense_arch[0].in_features, args.seed)
    per_rank = [[data.batch(first_step + k, r) for k in range(HELD_OUT)] for r in range(args.nproc)]
    labels = torch.cat([b.labels for r in range(args.nproc) for b in per_rank[r]])
    fp32_ctr = torch.cat([predicted_ctr(model, b) for r in range(args.nproc) for b in per_rank[r]])
    print(
        f"quantized serving on {args.nproc} ranks, {HELD_OUT} held-out batches of {args.batch_size} samples "
        f"per rank (fp32 model: AUC {auc(fp32_ctr, labels):.4f}):",
        flush=True,
    )
    plans = _plans(model, tables, args)
    from shardkit.cli.demo import timeout_env

    ranks = run_world(
        serve_rank,
        args.nproc,
        model,
        plans,
        tables,
        args.batch_size,
        first_step,
        args.seed,
        env=timeout_env(args),  # --timeout bounds the serving ranks' collectives too
    )
    ok = True
    for data_type in DATA_TYPES:
        name = data_type.value
        sharded_ctr = torch.cat([r[name]["ctr"] for r in ranks])
        unsharded = copy.deepcopy(model)
        unsharded.ebc = QuantEmbeddingBagCollection.from_float(model.ebc, data_type=data_type)
        unsharded_ctr = torch.cat(
            [predicted_ctr(unsharded, b) for r in range(args.nproc) for b in per_rank[r]]
        )
        exact = float((sharded_ctr - unsharded_ctr).abs().max())
        ok &= exact <= tolerance
        sizes = [(r[name]["bytes"], max(r[name]["fp32_bytes"], 1)) for r in ranks]
        memory = ", ".join(
            f"rank {i} {b / MIB:.2f} MiB ({b / f:.2f}x fp32)" for i, (b, f) in enumerate(sizes)
        )
        moved = (sharded_ctr - fp32_ctr).abs()
        print(f"  {name.lower()}: tables {memory}")
        print(
            f"        predicted CTR vs fp32: mean abs difference {float(moved.mean()):.2e}, max "
            f"{float(moved.max()):.2e}; AUC {auc(sharded_ctr, labels):.4f}; sharded vs unsharded "
            f"{name.lower()} {exact:.1e} {'ok' if exact <= tolerance else 'FAILED'}"
        )
    return ok
