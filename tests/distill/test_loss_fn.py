"""CrossTokenizerDistillationLoss: the configured objective from a data dict equals its parts."""

from __future__ import annotations

import pytest
import torch

from shardkit.distill import (
    CrossTokenizerDistillationLoss,
    DistillationConfig,
    TeacherLogitsBuffer,
    build_exact_token_map,
    clear_projection_caches,
    get_sparse_projection_matrix,
    gold_loss,
    projection_kl_loss,
    student_cross_entropy,
)
from tests.distill.test_losses import TS, VS, VT, _case


@pytest.fixture
def setup(tmp_path):
    clear_projection_caches()
    indices = torch.tensor([[i % VT, -1] if i % 2 else [(i + 3) % VT, i % VT] for i in range(VS)])
    likelihoods = torch.tensor([[1.0, 0.0] if i % 2 else [0.6, 0.4] for i in range(VS)])
    path = str(tmp_path / "p.pt")
    torch.save({"indices": indices, "likelihoods": likelihoods}, path)
    s_logits, t_logits, a, _, sm = _case(3)
    ids = torch.randint(0, VS, (s_logits.size(0), TS), generator=torch.Generator().manual_seed(7))
    data = {"input_ids": ids, "sample_mask": sm, **a.to_flat_batch()}
    yield path, s_logits, t_logits, a, sm, data
    clear_projection_caches()


@pytest.mark.parametrize("gold", [False, True])
def test_equals_its_parts(setup, gold):
    path, s_logits, t_logits, a, sm, data = setup
    cfg = DistillationConfig(
        projection_matrix_path=path,
        student_vocab_size=VS,
        teacher_vocab_size=VT,
        gold_loss=gold,
        xtoken_loss=gold,
        temperature=1.3,
        vocab_topk=7,
        uncommon_topk=4,
        kl_loss_weight=0.7,
        ce_loss_scale=0.2,
    )
    buffer = TeacherLogitsBuffer(t_logits.shape)
    buffer.update(t_logits)
    try:
        loss, metrics = CrossTokenizerDistillationLoss(cfg)(
            s_logits, {**data, "teacher_full_logits_ipc": buffer.entries()}
        )
    finally:
        buffer.close()
    if gold:
        emap = build_exact_token_map(path, "cpu", xtoken_loss=True, teacher_vocab_size=VT)
        kd, _ = gold_loss(
            s_logits,
            t_logits,
            a,
            emap,
            teacher_vocab_size=VT,
            temperature=1.3,
            uncommon_topk=4,
            sample_mask=sm,
        )
    else:
        m = get_sparse_projection_matrix(path, "cpu", student_vocab_size=VS, teacher_vocab_size=VT)
        kd, _ = projection_kl_loss(s_logits, t_logits, a, m, vocab_topk=7, temperature=1.3, sample_mask=sm)
    ce = student_cross_entropy(s_logits, data["input_ids"], sample_mask=sm)
    torch.testing.assert_close(loss, 0.7 * kd + 0.2 * ce)
    torch.testing.assert_close(metrics["kd_loss"], kd)
    torch.testing.assert_close(metrics["ce_loss"], ce)


def test_config_and_data_errors(setup):
    path, s_logits, t_logits, _, _, data = setup
    with pytest.raises(ValueError, match="xtoken_loss=True requires gold_loss=True"):
        DistillationConfig(path, VS, VT, gold_loss=False, xtoken_loss=True)
    fn = CrossTokenizerDistillationLoss(DistillationConfig(path, VS, VT, dynamic_loss_scaling=True))
    with pytest.raises(KeyError, match="teacher_full_logits_ipc"):
        fn(s_logits, data)
    loss, metrics = fn(s_logits, data, t_logits)
    torch.testing.assert_close(loss, 2 * metrics["ce_loss"])  # the distillation term rescaled to ce
    with pytest.raises(KeyError, match="alignment_num_chunks"):
        fn(s_logits, {k: v for k, v in data.items() if k != "alignment_num_chunks"}, t_logits)
