"""End to end: a tiny teacher LM distilled into a tiny student LM with a different tokenizer.

Real tokenizers (trained on the fly), a projection built from their vocabularies, the aligner,
teacher logits handed over through the shared-memory buffer, the configured loss. The loss goes
down over training steps; with dp=2 the loss and the summed gradients equal dp=1 on the same
global batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.distill import (
    CrossTokenizerDistillationLoss,
    DistillationConfig,
    TeacherLogitsBuffer,
    TokenAligner,
    build_projection,
    clear_projection_caches,
)
from shardkit.testing import run_world
from tests.distill._tokenizers import CORPUS, SPECIAL, encoder, tokenizers

TEXTS = CORPUS[:4]
T_S, T_T = 20, 18


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, seed: int, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        # a causal running mean gives each position some context
        h = h.cumsum(1) / torch.arange(1, ids.size(1) + 1).view(1, -1, 1)
        return self.head(torch.tanh(self.mix(h)))


def _setup(tmp_dir, gold: bool):
    student_tok, teacher_tok, _ = tokenizers()
    proj = build_projection(
        student_tok.get_vocab(),
        teacher_tok.get_vocab(),
        student_scheme="byte_level",
        teacher_scheme="byte_level",
        student_special=[SPECIAL],
        teacher_special=[SPECIAL],
    )
    path = f"{tmp_dir}/projection.pt"
    proj.save(path)
    aligned = TokenAligner(encoder(student_tok), encoder(teacher_tok))(
        TEXTS, student_length=T_S, teacher_length=T_T
    )
    config = DistillationConfig(
        projection_matrix_path=path,
        student_vocab_size=student_tok.get_vocab_size(),
        teacher_vocab_size=teacher_tok.get_vocab_size(),
        gold_loss=gold,
        xtoken_loss=gold,
        temperature=1.5,
        vocab_topk=64,
        uncommon_topk=32,
        kl_loss_weight=1.0,
        ce_loss_scale=0.1,
    )
    teacher = TinyLM(teacher_tok.get_vocab_size(), seed=1).requires_grad_(False)
    with torch.no_grad():
        teacher.head.weight.mul_(20.0)  # a confident teacher, as a trained one is
    student = TinyLM(student_tok.get_vocab_size(), seed=2)
    data = {
        "input_ids": aligned.student_ids,
        "token_mask": aligned.student_mask,
        "sample_mask": torch.ones(len(TEXTS)),
        **aligned.alignment.to_flat_batch(),
    }
    return config, teacher, student, aligned, data


def _microbatch(data, lo, hi):
    return {k: v[lo:hi] for k, v in data.items()}


@pytest.mark.parametrize("gold", [False, True])
def test_distillation_loss_decreases(tmp_path, gold):
    clear_projection_caches()
    config, teacher, student, aligned, data = _setup(tmp_path, gold)
    loss_fn = CrossTokenizerDistillationLoss(config)
    buffer = TeacherLogitsBuffer((len(TEXTS), T_T, config.teacher_vocab_size))
    buffer.update(teacher(aligned.teacher_ids))
    opt = torch.optim.Adam(student.parameters(), lr=0.05)
    kd_values = []
    try:
        for _ in range(8):
            for lo, hi in ((0, 2), (2, 4)):  # two microbatches read their slices of the shared buffer
                mb = {**_microbatch(data, lo, hi), "teacher_full_logits_ipc": buffer.entries()[lo:hi]}
                loss, metrics = loss_fn(student(mb["input_ids"]), mb)
                assert int(metrics["num_valid_chunks"]) > 0 and torch.isfinite(loss)
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                full = {**data, "teacher_full_logits_ipc": buffer.entries()}
                kd_values.append(loss_fn(student(data["input_ids"]), full)[1]["kd_loss"].item())
    finally:
        buffer.close()
    # the projection KL has a floor: top-k teacher tokens that no student token projects onto
    assert kd_values[-1] < kd_values[0] - (0.5 if not gold else 0.5 * kd_values[0]), kd_values
    assert all(b < a for a, b in zip(kd_values[:4], kd_values[1:5])), kd_values
    clear_projection_caches()


def _dp_step(config, data, t_logits, student_state):
    """Rank r computes on samples [2r, 2r + 2); every rank also computes the dp=1 reference.

    Everything is prepared once by the test process and passed in: ranks that each wrote the
    projection file to the same path would race with each other's reads.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    tp = singles[rank]  # the student is not vocabulary-sharded here
    clear_projection_caches()
    student = TinyLM(config.student_vocab_size, seed=0)
    student.load_state_dict(student_state)
    loss_fn = CrossTokenizerDistillationLoss(config)

    def run(lo, hi, dp_group):
        student.zero_grad()
        mb = _microbatch(data, lo, hi)
        loss, metrics = loss_fn(student(mb["input_ids"]), mb, t_logits[lo:hi], tp_group=tp, dp_group=dp_group)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in student.named_parameters()}, metrics

    ref_loss, ref_grads, ref_metrics = run(0, len(TEXTS), None)
    per = len(TEXTS) // world
    loss, grads, metrics = run(rank * per, (rank + 1) * per, dist.group.WORLD)
    for g in grads.values():
        dist.all_reduce(g)  # what DDP's sum does
    assert metrics["global_valid_chunks"] == ref_metrics["global_valid_chunks"]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    clear_projection_caches()
    return float(loss), int(metrics["num_valid_chunks"]), int(ref_metrics["num_valid_chunks"])


@pytest.mark.parametrize("gold", [False, True])
def test_data_parallel_equals_single_process(tmp_path, gold):
    clear_projection_caches()
    config, teacher, student, aligned, data = _setup(tmp_path, gold)
    with torch.no_grad():
        t_logits = teacher(aligned.teacher_ids)
    results = run_world(_dp_step, 2, config, data, t_logits, student.state_dict())
    assert results[0][0] == pytest.approx(results[1][0])  # the global loss on every rank
    assert results[0][1] + results[1][1] == results[0][2] > 0  # the chunks split between the ranks
    clear_projection_caches()
