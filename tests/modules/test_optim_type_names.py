"""fbgemm's ``EmbOptimType.EXACT_*`` spellings on ``OptimType`` (torchrec programs pass them in
``fused_params``). shardkit's rules are the exact ones (duplicate ids of a row summed before one
update: test_fused_optimizers.test_fused_matches_torch_optim checks that against torch's optimizers on
batches with repeated ids), so each ``EXACT_*`` name is the same member."""

from __future__ import annotations

import pytest

from shardkit.modules import FusedOptimizerConfig, OptimType
from shardkit.sharding.fused_optimizer_config import fused_optimizer_config

EXACT = {"EXACT_SGD": "SGD", "EXACT_ADAGRAD": "ADAGRAD", "EXACT_ROWWISE_ADAGRAD": "ROWWISE_ADAGRAD"}


@pytest.mark.parametrize("exact, rule", sorted(EXACT.items()))
def test_exact_member_is_the_rule(exact, rule):
    assert getattr(OptimType, exact) is OptimType[rule]
    assert OptimType[exact] is OptimType[rule]
    assert FusedOptimizerConfig(getattr(OptimType, exact), lr=0.5).optimizer is OptimType[rule]
    config = fused_optimizer_config({"optimizer": getattr(OptimType, exact), "learning_rate": 0.5})
    assert config.optimizer is OptimType[rule] and config.lr == 0.5


def test_iteration_lists_each_rule_once():
    assert [t.name for t in OptimType] == ["SGD", "ADAGRAD", "ROWWISE_ADAGRAD", "ADAM"]


def test_an_emb_optim_type_shardkit_lacks_stays_an_attribute_error():
    with pytest.raises(AttributeError, match="PARTIAL_ROWWISE_ADAM"):
        OptimType.PARTIAL_ROWWISE_ADAM  # noqa: B018
