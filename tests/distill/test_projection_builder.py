"""The projection builder on real vocabularies: canonical strings, both file formats, coverage."""

from __future__ import annotations

import pytest
import torch

from shardkit.distill import build_exact_token_map, clear_projection_caches, parse_projection_file
from shardkit.distill.projection_builder import build_projection, canonical_token
from tests.distill._tokenizers import SPECIAL, tokenizers


@pytest.fixture(autouse=True)
def _fresh_caches():
    clear_projection_caches()
    yield
    clear_projection_caches()


def test_canonical_strings():
    assert canonical_token("\u0120the", "byte_level") == b" the"
    assert canonical_token("\u010a", "byte_level") == b"\n"
    assert canonical_token("\u00c3\u00a9", "byte_level") == "\u00e9".encode()
    assert canonical_token("\u2581the", "sentencepiece") == b" the"
    assert canonical_token("<0x0A>", "sentencepiece") == b"\n"
    assert canonical_token("caf\u00e9", "plain") == "caf\u00e9".encode()
    with pytest.raises(ValueError, match="scheme"):
        canonical_token("a", "wordpiece")


def _canon(tok, i):
    return canonical_token(tok.id_to_token(i), "byte_level")


@pytest.mark.parametrize("teacher_index", [1, 2])
def test_real_vocabularies(tmp_path, teacher_index):
    toks = tokenizers()
    student, teacher = toks[0], toks[teacher_index]
    proj = build_projection(
        student.get_vocab(),
        teacher.get_vocab(),
        student_scheme="byte_level",
        teacher_scheme="byte_level",
        student_special=[SPECIAL],
        teacher_special=[SPECIAL],
    )
    rep = proj.report
    v_s = student.get_vocab_size()
    assert rep.exact + rep.multi + rep.none == v_s == rep.student_vocab_size
    assert rep.none == 0  # both vocabularies hold all 256 bytes
    assert str(v_s) in str(rep)
    teacher_bytes = {}
    for t in range(teacher.get_vocab_size()):
        if teacher.id_to_token(t) != SPECIAL:
            teacher_bytes.setdefault(_canon(teacher, t), t)
    n_exact = 0
    for s, row in enumerate(proj.rows):
        if student.id_to_token(s) == SPECIAL:
            assert row == [(teacher.token_to_id(SPECIAL), 1.0)]
            n_exact += 1
            continue
        sb = _canon(student, s)
        if sb in teacher_bytes:
            assert row == [(teacher_bytes[sb], 1.0)]
            n_exact += 1
        else:
            assert len(row) >= 1 and abs(sum(w for _, w in row) - 1.0) < 1e-6
            # the split's pieces rebuild the student token's bytes
            total = sum(proj.counts[(s, t)] * len(_canon(teacher, t)) for t, _ in row)
            assert total == len(sb) and all(_canon(teacher, t) in sb for t, _ in row)
    assert n_exact == rep.exact
    if teacher_index == 2:  # the byte-level teacher: exact exactly for one-byte tokens
        assert rep.exact == 1 + sum(len(_canon(student, s)) == 1 for s in range(v_s))

    dense, sparse = tmp_path / "p.pt", tmp_path / "s.pt"
    proj.save(dense)
    proj.save(sparse, format="sparse")
    idx, val, v_s_file, _ = parse_projection_file(dense)
    assert v_s_file == v_s
    m_dense = torch.zeros(v_s, teacher.get_vocab_size())
    keep = idx[1] >= 0
    m_dense.index_put_((idx[0][keep], idx[1][keep]), val[keep], accumulate=True)
    idx, val, _, _ = parse_projection_file(sparse)
    m_counts = torch.zeros_like(m_dense)
    m_counts.index_put_((idx[0], idx[1]), val, accumulate=True)
    # row-normalized counts are the dense likelihoods (no row is longer than the default k)
    torch.testing.assert_close(m_counts / m_counts.sum(1, keepdim=True), m_dense)
    emap = build_exact_token_map(dense, "cpu", xtoken_loss=False, teacher_vocab_size=teacher.get_vocab_size())
    assert emap["common_student"].numel() == rep.exact
    for s, t in zip(emap["common_student"].tolist(), emap["common_teacher"].tolist()):
        assert proj.rows[s] == [(t, 1.0)]


def test_none_special_and_top_k():
    proj = build_projection(
        ["a", "ab", "abc", "z", "<s>", "<pad>"],
        ["<s>", "a", "b", "c"],
        student_scheme="plain",
        teacher_scheme="plain",
        student_special=["<s>", "<pad>"],
        teacher_special=["<s>"],
    )
    assert (proj.report.exact, proj.report.multi, proj.report.none) == (2, 2, 2)
    assert proj.report.none_ids == [3, 5]
    assert proj.rows[2] == [(1, 1 / 3), (2, 1 / 3), (3, 1 / 3)]
    indices, likelihoods = proj.topk_arrays(top_k=2)
    assert indices[2].tolist() == [1, 2] and likelihoods[2].tolist() == [0.5, 0.5]
    assert indices[3].tolist() == [-1, -1] and indices[0].tolist() == [1, -1]
    with pytest.raises(ValueError, match="format"):
        proj.save("x.pt", format="csv")
    with pytest.raises(ValueError, match="no token for ids"):
        build_projection({"a": 0, "b": 2}, ["a"], student_scheme="plain", teacher_scheme="plain")
