"""torchrec's golden DLRM training, ported to shardkit by changing its imports (plus an EC and feature
processors fed by the same KJT, and a plan written with the sharding-plan helpers).

    torchrun --nproc-per-node 2 examples/train_dlrm_golden.py --steps 100
    python examples/train_dlrm_golden.py --steps 20            # one process

What it exercises, all with torchrec's names and idioms: ``RandomRecDataset`` batches of the Criteo
feature names; ``DLRM`` / ``DLRMTrain`` over an ``EmbeddingBagCollection`` built on the meta device
whose tables get ``RowWiseAdagrad`` through ``apply_optimizer_in_backward``; an ``EmbeddingCollection``
and a ``FeatureProcessedEmbeddingBagCollection`` (position weights) that read the same KJT, their
tables trained by the sharders' ``fused_params``; quantized comms from ``get_qcomm_codecs_registry``;
a ``ShardingPlan`` from ``construct_module_sharding_plan`` with ``table_wise`` / ``row_wise`` /
``column_wise``; the dense parameters trained by Adagrad through ``KeyedOptimizerWrapper`` over
``in_backward_optimizer_filter``; ``TrainPipelineSparseDist``. Rank 0 prints the plan and the mean loss
of each tenth of the run.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import torch
import torch._dynamo  # noqa: F401 - before init_process_group (torch.optim imports it later): docs/running.md
import torch.distributed as dist
from torch import nn

from shardkit import EmbeddingBagCollection, EmbeddingCollection
from shardkit.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from shardkit.datasets.random import RandomRecDataset
from shardkit.datasets.utils import Batch
from shardkit.distributed.codecs import CommType, QCommsConfig, get_qcomm_codecs_registry
from shardkit.model_parallel import DistributedModelParallel
from shardkit.models.dlrm import DLRM, DLRMTrain
from shardkit.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from shardkit.modules.feature_processor_ import PositionWeightedModule
from shardkit.modules.fp_embedding_bag_collection import FeatureProcessedEmbeddingBagCollection
from shardkit.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from shardkit.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from shardkit.optim.optimizers import in_backward_optimizer_filter
from shardkit.optim.rowwise_adagrad import RowWiseAdagrad
from shardkit.pipeline import TrainPipelineSparseDist
from shardkit.sharding.embedding import EmbeddingCollectionSharder
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from shardkit.sharding.types import ShardingPlan

SEQUENCE_FEATURE = DEFAULT_CAT_NAMES[0]  # also looked up, one row per id, by the EmbeddingCollection
POSITION_FEATURE = DEFAULT_CAT_NAMES[1]  # also looked up with position weights


class DLRMWithExtras(nn.Module):
    """``DLRMTrain`` plus two more collections on the same KJT, whose outputs feed a second logit."""

    def __init__(
        self,
        dlrm: DLRMTrain,
        ec: EmbeddingCollection,
        fp_ebc: FeatureProcessedEmbeddingBagCollection,
        device: torch.device,
    ):
        super().__init__()
        self.dlrm, self.ec, self.fp_ebc = dlrm, ec, fp_ebc
        dim = (
            ec.embedding_configs()[0].embedding_dim
            + fp_ebc.embedding_bag_collection.embedding_bag_configs()[0].embedding_dim
        )
        self.extra_head = nn.Linear(dim, 1, device=device)

    def forward(self, batch: Batch):
        loss, (_, logits, labels) = self.dlrm(batch)
        sequence = self.ec(batch.sparse_features)[SEQUENCE_FEATURE]
        first_ids = sequence.to_padded_dense(desired_length=1)[:, 0]  # [B, D]: each bag's first row
        weighted = self.fp_ebc(batch.sparse_features)[POSITION_FEATURE]  # [B, D]
        extra = self.extra_head(torch.cat([first_ids, weighted], dim=1)).squeeze(-1)
        loss = loss + nn.functional.binary_cross_entropy_with_logits(extra, labels.float())
        return loss, (loss.detach(), logits, labels)


def build_model(num_embeddings: int, dim: int, device: torch.device, lr: float) -> DLRMWithExtras:
    eb_configs = [
        EmbeddingBagConfig(
            name=f"t_{name}", embedding_dim=dim, num_embeddings=num_embeddings, feature_names=[name]
        )
        for name in DEFAULT_CAT_NAMES
    ]
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=eb_configs, device=torch.device("meta")),
        dense_in_features=len(DEFAULT_INT_NAMES),
        dense_arch_layer_sizes=[32, dim],
        over_arch_layer_sizes=[32, 1],
        dense_device=device,
    )
    train_model = DLRMTrain(dlrm)
    apply_optimizer_in_backward(RowWiseAdagrad, train_model.model.sparse_arch.parameters(), {"lr": lr})
    ec = EmbeddingCollection(
        tables=[
            EmbeddingConfig(
                name="t_seq",
                embedding_dim=dim,
                num_embeddings=num_embeddings,
                feature_names=[SEQUENCE_FEATURE],
            )
        ],
        device=torch.device("meta"),
    )
    fp_ebc = FeatureProcessedEmbeddingBagCollection(
        EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="t_pos",
                    embedding_dim=dim,
                    num_embeddings=num_embeddings,
                    feature_names=[POSITION_FEATURE],
                )
            ],
            is_weighted=True,
            device=torch.device("meta"),
        ),
        {POSITION_FEATURE: PositionWeightedModule(max_feature_length=4, device=device)},
    )
    return DLRMWithExtras(train_model, ec, fp_ebc, device)


def build_plan(model: DLRMWithExtras, world_size: int, device_type: str) -> ShardingPlan:
    """The DLRM's tables dealt out table-wise, the first two row-wise and column-wise (their kernel is
    fused: they carry an optimizer in backward); the EC's table table-wise, the FP-EBC's row-wise."""
    last = world_size - 1
    ebc = model.dlrm.model.sparse_arch.embedding_bag_collection
    ebc_gens = {f"t_{name}": table_wise(rank=i % world_size) for i, name in enumerate(DEFAULT_CAT_NAMES)}
    ebc_gens[f"t_{DEFAULT_CAT_NAMES[0]}"] = row_wise()
    ebc_gens[f"t_{DEFAULT_CAT_NAMES[1]}"] = column_wise(ranks=[0, last])
    plans = {
        "dlrm.model.sparse_arch.embedding_bag_collection": (ebc, ebc_gens),
        # fused: trained in backward by their sharders' fused_params (the default would be dense)
        "ec": (model.ec, {"t_seq": table_wise(rank=last, compute_kernel="fused")}),
        "fp_ebc": (model.fp_ebc, {"t_pos": row_wise(compute_kernel="fused")}),
    }
    return ShardingPlan(
        {
            path: construct_module_sharding_plan(module, gens, world_size=world_size, device_type=device_type)
            for path, (module, gens) in plans.items()
        }
    )


def train(num_embeddings: int, dim: int, lr: float, steps: int, batch_size: int) -> List[float]:
    rank = dist.get_rank()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    model = build_model(num_embeddings, dim, device, lr)
    plan = build_plan(model, dist.get_world_size(), device.type)
    if rank == 0:
        print(plan, flush=True)
    qcomm_codecs_registry = get_qcomm_codecs_registry(
        qcomms_config=QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.BF16)
    )
    fused_params = {"optimizer": "EXACT_ROWWISE_ADAGRAD", "learning_rate": lr}
    sharders = [
        EmbeddingBagCollectionSharder(qcomm_codecs_registry=qcomm_codecs_registry),
        EmbeddingCollectionSharder(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry),
        FeatureProcessedEmbeddingBagCollectionSharder(
            fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry
        ),
    ]
    model = DistributedModelParallel(module=model, device=device, sharders=sharders, plan=plan)
    dense_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=lr),
    )
    optimizer = CombinedOptimizer([model.fused_optimizer, dense_optimizer])
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    dataset = RandomRecDataset(
        keys=DEFAULT_CAT_NAMES,
        batch_size=batch_size,
        hash_size=num_embeddings,
        ids_per_feature=3,
        min_ids_per_feature=1,
        num_dense=len(DEFAULT_INT_NAMES),
        manual_seed=rank,  # each rank its own samples
    )
    batches = iter(dataset)
    return [float(pipeline.progress(batches)[0]) for _ in range(steps)]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-embeddings", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args(argv)
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        losses = train(args.num_embeddings, args.dim, args.lr, args.steps, args.batch_size)
        mean = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(mean)  # every rank's loss, averaged
        mean = (mean / dist.get_world_size()).tolist()
        if dist.get_rank() == 0:
            tenth = max(len(mean) // 10, 1)
            chunks = [mean[i : i + tenth] for i in range(0, len(mean), tenth)]
            print("mean loss per tenth: " + " ".join(f"{sum(c) / len(c):.4f}" for c in chunks))
    finally:  # also after an error: a group alive at exit can abort the interpreter (docs/running.md)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
