"""The aligner on real tokenizers: every chunk pair's texts are equal and the chunks cover the text."""

from __future__ import annotations

import pytest
import torch

from shardkit.distill.aligner import TokenAligner, align_offsets, alignment_batch_from_offsets
from shardkit.distill.projection_builder import canonical_token
from tests.distill._tokenizers import CORPUS, encoder, tokenizers

TEXTS = CORPUS + ["", "x", "  leading and trailing  ", "\u00e9\u00e9\u00e9 \U0001f600\U0001f600"]


def _chunk_bytes(tok, ids):
    # tokens of one byte-level chunk can share offsets: compare the bytes they stand for
    return b"".join(canonical_token(tok.id_to_token(i), "byte_level") for i in ids)


@pytest.mark.parametrize("pair", [(0, 1), (0, 2), (1, 2)])
def test_chunks_are_equal_texts_and_cover_the_text(pair):
    toks = tokenizers()
    student, teacher = toks[pair[0]], toks[pair[1]]
    for text in TEXTS:
        s, t = student.encode(text), teacher.encode(text)
        pairs = align_offsets(s.offsets, t.offsets)
        position = 0
        for p in pairs:
            assert p.is_correct
            assert p.char_start == position  # contiguous ...
            position = p.char_end
            chunk_text = text[p.char_start : p.char_end].encode("utf-8")
            assert _chunk_bytes(student, s.ids[p.student_start : p.student_end]) == chunk_text
            assert _chunk_bytes(teacher, t.ids[p.teacher_start : p.teacher_end]) == chunk_text
        assert position == len(text)  # ... and covering the whole text
        # every token is in exactly one chunk
        assert [i for p in pairs for i in range(p.student_start, p.student_end)] == list(range(len(s.ids)))
        assert [i for p in pairs for i in range(p.teacher_start, p.teacher_end)] == list(range(len(t.ids)))
        # chunks are as fine as possible: no chunk splits into two with a common boundary inside
        for p in pairs:
            s_ends = {s.offsets[i][1] for i in range(p.student_start, p.student_end - 1)}
            t_ends = {t.offsets[i][1] for i in range(p.teacher_start, p.teacher_end - 1)}
            inside = {
                e
                for e in s_ends & t_ends
                if e < p.char_end
                and all(not (a < e < b) for a, b in s.offsets[p.student_start : p.student_end])
                and all(not (a < e < b) for a, b in t.offsets[p.teacher_start : p.teacher_end])
            }
            assert not inside


def test_batch_tensors_and_next_token_layout():
    student, teacher, _ = tokenizers()
    aligner = TokenAligner(encoder(student), encoder(teacher), student_pad_id=0, teacher_pad_id=0)
    texts = [CORPUS[0], CORPUS[3], "hi"]
    out = aligner(texts)
    a = out.alignment
    b = len(texts)
    assert out.student_ids.shape[0] == b and a.student_chunk_id.shape == out.student_ids.shape
    assert a.teacher_chunk_id.shape == out.teacher_ids.shape
    for i, pairs in enumerate(out.pairs):
        assert a.num_chunks[i] == len(pairs)
        assert a.pair_valid[i].tolist() == [k < len(pairs) for k in range(a.pair_valid.size(1))]
        for k, p in enumerate(pairs):
            assert torch.all(a.student_chunk_id[i, p.student_start : p.student_end] == k)
            assert torch.all(a.teacher_chunk_id[i, p.teacher_start : p.teacher_end] == k)
            one = p.student_end - p.student_start == 1 and p.teacher_end - p.teacher_start == 1
            assert bool(a.student_exact_partition_mask[i, p.student_start]) == one
        # padding is in no chunk
        assert torch.all(a.student_chunk_id[i][~out.student_mask[i]] == -1)
        assert torch.all(a.teacher_chunk_id[i][~out.teacher_mask[i]] == -1)
        assert torch.all(a.student_chunk_id[i][out.student_mask[i]] >= 0)
        s_ids = out.student_ids[i][out.student_mask[i]].tolist()
        assert s_ids == student.encode(texts[i]).ids


def test_truncation_keeps_only_text_covered_on_both_sides():
    student, teacher, byte_level = tokenizers()
    text = CORPUS[1]
    s, t = student.encode(text), byte_level.encode(text)
    batch, pairs = alignment_batch_from_offsets(
        [s.offsets], [t.offsets], student_length=30, teacher_length=20
    )
    covered = pairs[0][-1].char_end
    assert covered <= t.offsets[19][1]
    for p in pairs[0]:
        assert p.is_correct and p.char_end <= covered
        assert (
            _chunk_bytes(student, s.ids[p.student_start : p.student_end])
            == text[p.char_start : p.char_end].encode()
        )
    kept = batch.student_chunk_id[0] >= 0
    assert all(s.offsets[i][1] <= covered for i in range(30) if kept[i])


def test_special_tokens_gaps_and_bad_offsets():
    # a zero-width BOS on the student side, and a teacher that drops the space at [3, 4)
    pairs = align_offsets([(0, 0), (0, 3), (3, 7)], [(0, 3), (4, 7)])
    assert [(p.student_start, p.student_end, p.teacher_start, p.teacher_end) for p in pairs] == [
        (1, 2, 0, 1),
        (2, 3, 1, 2),
    ]
    assert [p.is_correct for p in pairs] == [True, False]  # " word" vs "word": texts differ
    one_sided = align_offsets([(0, 2), (2, 4)], [(0, 2)])
    assert one_sided[1].teacher_start == -1 and not one_sided[1].is_correct
    with pytest.raises(ValueError, match="non-decreasing"):
        align_offsets([(3, 4), (0, 2)], [(0, 4)])
    with pytest.raises(ValueError, match="invalid offsets"):
        align_offsets([(3, 2)], [(0, 4)])
