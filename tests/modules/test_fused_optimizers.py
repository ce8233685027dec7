"""Fused sparse optimizers against torch.optim on a dense copy, over several steps with repeated ids."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedOptimizerConfig,
    GroupedEmbeddingLookup,
    OptimType,
    PoolingType,
    ShardSpec,
)
from tests.modules._inputs import random_kjt

ROWS, DIM = 12, 5


def _batches(steps: int, weighted: bool):
    """Flat (ids, offsets, weights) batches with repeated ids inside and across bags."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 5, (6,), generator=gen)
        ids = torch.randint(0, 4, (int(lengths.sum()),), generator=gen) * 3  # rows 0, 3, 6, 9 only
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        weights = torch.rand(ids.numel(), generator=gen) + 0.5 if weighted else None
        out.append((ids, offsets, weights))
    return out


class _RowwiseAdagradReference:
    """Row-wise Adagrad from its definition: per row, sum += mean_j(g_j^2); w -= lr g / (sqrt(sum) + eps)."""

    def __init__(self, weight: torch.Tensor, lr: float, eps: float) -> None:
        self.weight, self.lr, self.eps = weight, lr, eps
        self.sum = torch.zeros(weight.shape[0])

    def step(self) -> None:
        grad = self.weight.grad
        touched = grad.abs().sum(dim=1) > 0  # the fused optimizer visits only rows that were looked up
        for row in touched.nonzero().flatten().tolist():
            g = grad[row]
            self.sum[row] += float((g * g).mean())
            with torch.no_grad():
                self.weight[row] -= self.lr * g / (self.sum[row].sqrt() + self.eps)


def _reference_optimizer(opt: OptimType, weight: torch.Tensor, lr: float):
    if opt is OptimType.SGD:
        return torch.optim.SGD([weight], lr=lr)
    if opt is OptimType.ADAGRAD:
        return torch.optim.Adagrad([weight], lr=lr)
    if opt is OptimType.ADAM:
        return torch.optim.SparseAdam([weight], lr=lr)
    return _RowwiseAdagradReference(weight, lr, eps=1e-10)


@pytest.mark.parametrize("opt", list(OptimType))
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_matches_torch_optim(opt, weighted):
    config = EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="t", feature_names=["f"])
    lookup = GroupedEmbeddingLookup(
        [ShardSpec(config)], pooled=True, fused_optimizer=FusedOptimizerConfig(opt, lr=0.1)
    )
    dense = lookup.weight.detach().clone().requires_grad_(True)
    reference = _reference_optimizer(opt, dense, lr=0.1)
    target = torch.randn(6, DIM, generator=torch.Generator().manual_seed(2))
    for ids, offsets, weights in _batches(4, weighted):
        out = lookup(ids, offsets, [6], weights)
        ((out - target) ** 2).sum().backward()
        assert lookup.weight.grad is None  # no dense gradient, ever

        sparse = opt is OptimType.ADAM  # SparseAdam needs a sparse gradient
        ref_out = F.embedding_bag(
            ids,
            dense,
            offsets,
            mode="sum",
            per_sample_weights=weights,
            include_last_offset=True,
            sparse=sparse,
        )
        ((ref_out - target) ** 2).sum().backward()
        reference.step()
        dense.grad = None
        torch.testing.assert_close(lookup.weight.detach(), dense.detach(), rtol=1e-5, atol=1e-6)
    untouched = [r for r in range(ROWS) if r % 3 != 0]
    assert lookup.optimizer.step_count == 4
    assert torch.equal(lookup.weight.detach()[untouched], dense.detach()[untouched])


def test_per_sample_weight_gradient_with_fused_optimizer():
    config = EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="t", feature_names=["f"])
    lookup = GroupedEmbeddingLookup(
        [ShardSpec(config)], pooled=True, fused_optimizer=FusedOptimizerConfig("SGD")
    )
    dense = lookup.weight.detach().clone().requires_grad_(True)
    ids, offsets, weights = _batches(1, True)[0]
    w1, w2 = weights.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    lookup(ids, offsets, [6], w1).pow(2).sum().backward()
    ref = F.embedding_bag(ids, dense, offsets, per_sample_weights=w2, mode="sum", include_last_offset=True)
    ref.pow(2).sum().backward()
    torch.testing.assert_close(w1.grad, w2.grad)


def test_fused_half_precision_table_updates_in_fp32():
    config = EmbeddingBagConfig(
        num_embeddings=ROWS, embedding_dim=DIM, name="t", feature_names=["f"], data_type="FP16"
    )
    lookup = GroupedEmbeddingLookup(
        [ShardSpec(config)], pooled=True, fused_optimizer=FusedOptimizerConfig("ADAGRAD")
    )
    dense = lookup.weight.detach().float().clone().requires_grad_(True)
    reference = torch.optim.Adagrad([dense], lr=0.01)
    for ids, offsets, _ in _batches(3, False):
        lookup(ids, offsets, [6]).float().sum().backward()
        F.embedding_bag(ids, dense, offsets, mode="sum", include_last_offset=True).sum().backward()
        reference.step()
        dense.grad = None
        # the fp16 table is the fp32 result rounded once per step
        torch.testing.assert_close(lookup.weight.detach().float(), dense.detach(), rtol=2e-3, atol=2e-3)
        with torch.no_grad():
            dense.copy_(lookup.weight.float())
    assert lookup.optimizer.sum.dtype == torch.float32


@pytest.mark.parametrize("opt", [OptimType.ADAGRAD, OptimType.ROWWISE_ADAGRAD, OptimType.ADAM])
def test_state_dict_round_trip_and_resume(opt):
    tables = [
        EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="a", feature_names=["fa"]),
        EmbeddingBagConfig(
            num_embeddings=7, embedding_dim=DIM, name="b", feature_names=["fb"], pooling=PoolingType.MEAN
        ),
    ]
    config = FusedOptimizerConfig(opt, lr=0.05)
    first = EmbeddingBagCollection(tables, fused_optimizer=config)
    rows = {"fa": ROWS, "fb": 7}
    for seed in range(2):
        first(random_kjt(rows, batch=3, seed=seed)).values().sum().backward()
    state = first.fused_optimizer.state_dict()
    assert set(state["state"]) == {"a", "b"}
    assert state["state"]["a"]["step"] == 2
    if opt is OptimType.ROWWISE_ADAGRAD:
        assert state["state"]["b"]["sum"].shape == (7,)

    second = EmbeddingBagCollection(tables, fused_optimizer=config)
    second.load_state_dict(first.state_dict())
    second.fused_optimizer.load_state_dict(
        {"state": {k: dict(v) for k, v in state["state"].items()}, "lr": 0.05}
    )
    batch = random_kjt(rows, batch=3, seed=7)
    first(batch).values().sum().backward()
    second(batch).values().sum().backward()
    torch.testing.assert_close(first.table_weight("a"), second.table_weight("a"), rtol=0, atol=0)
    torch.testing.assert_close(first.table_weight("b"), second.table_weight("b"), rtol=0, atol=0)


def test_learning_rate_can_change_and_no_grad_skips_update():
    config = EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="t", feature_names=["f"])
    ebc = EmbeddingBagCollection([config], fused_optimizer=FusedOptimizerConfig("SGD", lr=0.1))
    before = ebc.table_weight("t").detach().clone()
    batch = random_kjt({"f": ROWS}, batch=2, seed=3)
    with torch.no_grad():
        ebc(batch)
    assert torch.equal(before, ebc.table_weight("t"))
    ebc.fused_optimizer.set_learning_rate(0.0)
    ebc(batch).values().sum().backward()
    assert torch.equal(before, ebc.table_weight("t"))
    assert ebc.fused_optimizer.lr == 0.0


def test_bad_optimizer_configs():
    with pytest.raises(ValueError):
        FusedOptimizerConfig("NOPE")
    with pytest.raises(ValueError, match="learning rate"):
        FusedOptimizerConfig(OptimType.SGD, lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        FusedOptimizerConfig(OptimType.ADAM, betas=(1.0, 0.9))
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="t", feature_names=["f"])]
    )
    with pytest.raises(ValueError, match="without fused_optimizer"):
        _ = ebc.fused_optimizer


@pytest.mark.parametrize("opt", list(OptimType))
def test_batch_without_ids_is_a_step_that_moves_nothing(opt):
    config = EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="t", feature_names=["f"])
    lookup = GroupedEmbeddingLookup(
        [ShardSpec(config)], pooled=True, fused_optimizer=FusedOptimizerConfig(opt)
    )
    before = lookup.weight.detach().clone()
    out = lookup(torch.zeros(0, dtype=torch.long), torch.zeros(4, dtype=torch.long), [3])
    assert out.shape == (3, DIM) and torch.count_nonzero(out) == 0
    out.sum().backward()
    assert torch.equal(before, lookup.weight.detach())
    assert lookup.optimizer.step_count == 1


@pytest.mark.parametrize("opt", [OptimType.SGD, OptimType.ADAGRAD])
def test_fused_collection_matches_dense_collection_with_mean_and_weights(opt):
    tables = [
        EmbeddingBagConfig(num_embeddings=9, embedding_dim=4, name="a", feature_names=["fa", "fb"]),
        EmbeddingBagConfig(
            num_embeddings=5, embedding_dim=4, name="m", feature_names=["fm"], pooling=PoolingType.MEAN
        ),
    ]
    fused = EmbeddingBagCollection(
        tables, is_weighted=True, fused_optimizer=FusedOptimizerConfig(opt, lr=0.2)
    )
    dense = EmbeddingBagCollection(tables, is_weighted=True)
    dense.load_state_dict(fused.state_dict())
    optimizer = (torch.optim.SGD if opt is OptimType.SGD else torch.optim.Adagrad)(dense.parameters(), lr=0.2)
    for seed in range(4):
        features = random_kjt({"fa": 9, "fb": 9, "fm": 5}, batch=3, weighted=True, seed=seed)
        fused(features).values().pow(2).sum().backward()
        dense(features).values().pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    for name in ["a", "m"]:
        torch.testing.assert_close(fused.table_weight(name), dense.table_weight(name), rtol=1e-5, atol=1e-6)
