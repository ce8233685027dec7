"""NeMo RL's ``TokenAligner`` surface (issue 28, item 3): the cases its aligner unit tests check,
written here against shardkit's front end, plus the front's agreement with the exact offset aligner."""

from __future__ import annotations

import inspect
from dataclasses import fields, is_dataclass

import pytest
import torch

from shardkit.distill import chunk_average_log_probs, valid_chunk_mask
from shardkit.distill import nemo_rl_aligner as na
from shardkit.distill.aligner import align_offsets
from shardkit.distill.nemo_rl_aligner import AlignmentPair, TokenAligner, _canonicalize_sequence
from tests.distill._tokenizers import CORPUS, tokenizers


class _Vocab:
    """A tokenizer stand-in: ``convert_ids_to_tokens`` from a dict, optional special-token ids."""

    def __init__(self, id_to_tok, **special):
        self.id_to_tok = id_to_tok
        for name, value in special.items():
            setattr(self, name, value)

    def convert_ids_to_tokens(self, ids):
        return [self.id_to_tok.get(int(i), f"<unk{i}>") for i in ids]


def _aligner(student_vocab, teacher_vocab, **special):
    return TokenAligner(_Vocab(student_vocab, **special), _Vocab(teacher_vocab, **special), "unused.pt")


def _ids(rows):
    return torch.tensor(rows, dtype=torch.long)


# --- the surface NeMo RL's tests pin -------------------------------------------------------------


def test_dp_kernel_is_reachable():
    assert hasattr(TokenAligner, "_align_dp") and callable(TokenAligner._align_dp)


@pytest.mark.parametrize("name", ["_align_dp", "_align_with_anchors"])
def test_kernel_signatures_take_no_var_keywords(name):
    params = inspect.signature(getattr(TokenAligner, name)).parameters.values()
    assert not [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    names = {p.name for p in params}
    assert {"exact_match_score", "combination_score_multiplier", "gap_penalty"} <= names


def test_alignment_pair_is_the_seven_field_record():
    assert is_dataclass(AlignmentPair)
    assert [f.name for f in fields(AlignmentPair)] == [
        "s_tokens",
        "t_tokens",
        "s_start",
        "s_end",
        "t_start",
        "t_end",
        "is_correct",
    ]
    assert AlignmentPair(["a"], [], 0, 1, -1, -1).is_correct is False


@pytest.mark.parametrize(
    "seq",
    [
        ["Hello", "\u0120world", "!"],
        ["abc", "def", "ghi", "jkl"],
        ["The", "\u0120quick", "\u0120brown", "\u0120fox"],
        ["<bos>", "Hello"],
        ["a", "b", "c"],
    ],
)
def test_canonicalize_keeps_clean_sequences_one_to_one(seq):
    canon, ranges = _canonicalize_sequence(seq)
    assert len(canon) == len(seq)
    assert ranges == [(i, i + 1) for i in range(len(seq))]


def test_canonicalize_merges_a_split_character_and_maps_it_back():
    # byte-level "ĠâĪ" + "ĳ" are the bytes 20 E2 88 | 91: together " ∑"
    canon, ranges = _canonicalize_sequence(["\u0120\u00e2\u012a", "\u0133"])
    assert canon == [" \u2211"] and ranges == [(0, 2)]
    # two byte tokens that spell "é", then a plain-text token
    canon, ranges = _canonicalize_sequence(["\u00c3", "\u00a9", "\u4e2d"])
    assert canon == ["\u00e9", "\u4e2d"] and ranges == [(0, 2), (2, 3)]
    # a lone byte that never completes stays as the text it spells
    assert _canonicalize_sequence(["\u00e9", "\u4e2d"]) == (["\u00e9", "\u4e2d"], [(0, 1), (1, 2)])
    # SentencePiece: "▁" is a space, <0x..> tokens are bytes and merge the same way
    assert _canonicalize_sequence(["\u2581Hi", "<0xC3>", "<0xA9>"]) == ([" Hi", "\u00e9"], [(0, 1), (1, 3)])
    assert _canonicalize_sequence([]) == ([], [])


# --- align(): chunk ids, padding, merged characters ----------------------------------------------


def test_identical_tokenizations_give_one_correct_pair_per_token():
    vocab = {1: "Hello", 2: "\u0120world", 3: "!"}
    ids = _ids([[1, 2, 3]])
    batch = _aligner(vocab, vocab).align(ids, ids.clone())
    assert batch.pair_valid[0].tolist() == [True] * 3
    assert batch.pair_is_correct[0].tolist() == [True] * 3
    assert batch.student_chunk_id[0].tolist() == [0, 1, 2]
    assert batch.teacher_chunk_id[0].tolist() == [0, 1, 2]
    assert batch.num_chunks.tolist() == [3]


def test_shapes_for_a_padded_row():
    vocab = {0: "<pad>", 1: "Hello", 2: "\u0120world", 3: "!", 4: "\u0120foo"}
    ids = _ids([[1, 2, 3, 0]])
    batch = _aligner(vocab, vocab).align(ids, ids.clone())
    assert batch.student_chunk_id.shape == (1, 4) and batch.teacher_chunk_id.shape == (1, 4)
    assert batch.pair_valid.dtype == torch.bool and batch.num_chunks.shape == (1,)
    assert int(batch.num_chunks[0]) <= batch.pair_valid.shape[1]


def test_attention_mask_keeps_padding_out_of_every_chunk():
    vocab = {0: "<pad>", 1: "Hello", 2: "\u0120world", 3: "!"}
    aligner = _aligner(vocab, vocab)
    ids = _ids([[1, 2, 3, 0, 0, 0], [1, 2, 3, 2, 3, 1]])
    mask = _ids([[1, 1, 1, 0, 0, 0], [1] * 6])
    unmasked = aligner.align(ids, ids.clone())
    # without a mask, "<pad>" is text like any other token and pairs with the other side's pads
    assert (unmasked.student_chunk_id[0, -3:] != -1).all()
    masked = aligner.align(ids, ids.clone(), student_attention_mask=mask, teacher_attention_mask=mask)
    assert (masked.student_chunk_id[0, -3:] == -1).all() and (masked.teacher_chunk_id[0, -3:] == -1).all()
    assert not masked.student_exact_partition_mask[0, -3:].any()
    assert not masked.teacher_exact_partition_mask[0, -3:].any()
    assert (masked.student_chunk_id[0, :3] != -1).all()
    assert torch.equal(masked.student_chunk_id[1], unmasked.student_chunk_id[1])
    assert masked.num_chunks.tolist() == [3, 6]
    # no chunk that survives valid_chunk_mask draws on padding only
    c = masked.pair_valid.size(1)
    dummy = torch.zeros(2, ids.size(1), 1)
    _, s_sizes = chunk_average_log_probs(dummy, masked.student_chunk_id, c)
    _, t_sizes = chunk_average_log_probs(dummy, masked.teacher_chunk_id, c)
    keep = valid_chunk_mask(s_sizes, t_sizes, masked.pair_valid)
    assert keep.sum() == 9 and (s_sizes[keep] > 0).all() and (t_sizes[keep] > 0).all()


def test_left_padding_is_dropped_position_by_position():
    vocab = {0: "<pad>", 1: "Hello", 2: "\u0120world"}
    ids = _ids([[0, 0, 1, 2]])
    mask = _ids([[0, 0, 1, 1]])
    batch = _aligner(vocab, vocab).align(
        ids, ids.clone(), student_attention_mask=mask, teacher_attention_mask=mask
    )
    assert batch.student_chunk_id[0].tolist() == [-1, -1, 0, 1]
    assert batch.student_exact_partition_mask[0].tolist() == [False, False, True, True]


def test_merged_artifact_tokens_share_the_teacher_chunk():
    student = {1: "Hello", 2: "\u0120\u00e2\u012a", 3: "\u0133", 4: "."}
    teacher = {1: "Hello", 2: "\u0120\u2211", 3: "."}
    batch = _aligner(student, teacher).align(_ids([[1, 2, 3, 4]]), _ids([[1, 2, 3]]))
    s_row, t_row = batch.student_chunk_id[0].tolist(), batch.teacher_chunk_id[0].tolist()
    assert s_row == [0, 1, 1, 2] and t_row == [0, 1, 2]
    assert batch.pair_is_correct[0].tolist() == [True, True, True]
    # the merged pair is correct but not one token to one token: off the exact partition
    assert batch.student_exact_partition_mask[0].tolist() == [True, False, False, True]
    assert batch.teacher_exact_partition_mask[0].tolist() == [True, False, True]
    assert all(0 <= c < int(batch.num_chunks[0]) for c in s_row + t_row)


def test_byte_fallback_tokens_share_the_teacher_chunk():
    student = {1: "\u00c3", 2: "\u00a9", 3: "\u4e2d"}
    teacher = {1: "\u00e9", 2: "\u4e2d"}
    batch = _aligner(student, teacher).align(_ids([[1, 2, 3]]), _ids([[1, 2]]))
    assert batch.student_chunk_id[0].tolist() == [0, 0, 1]
    assert batch.teacher_chunk_id[0].tolist() == [0, 1]


def test_special_tokens_pair_by_role_whatever_their_spelling():
    student = _Vocab({7: "<bos>", 1: "Hi"}, bos_token_id=7)
    teacher = _Vocab({8: "<|begin_of_text|>", 1: "Hi"}, bos_token_id=8)
    batch = TokenAligner(student, teacher).align(_ids([[7, 1]]), _ids([[8, 1]]))
    assert batch.student_chunk_id[0].tolist() == [0, 1] and batch.teacher_chunk_id[0].tolist() == [0, 1]
    assert batch.pair_is_correct[0].tolist() == [True, True]


# --- where the texts differ: the DP ---------------------------------------------------------------


def test_differing_texts_are_realigned_by_the_dp():
    aligner = TokenAligner(None, None)
    pairs = aligner._align_single(
        ["Hello", "\u0120wrld", "!", "\u0120foo"], ["Hello", "\u0120world", "!", "\u0120fo", "o"]
    )
    got = [(p.s_start, p.s_end, p.t_start, p.t_end, p.is_correct) for p in pairs]
    assert got == [(0, 1, 0, 1, True), (1, 2, 1, 2, False), (2, 3, 2, 3, True), (3, 4, 3, 5, True)]
    pairs = aligner._align_single(
        ["\u0120the", "\u0120cat", "\u0120sat"], ["\u0120the", "\u0120dog", "\u0120sat"]
    )
    assert [p.is_correct for p in pairs] == [True, False, True]
    assert [(p.s_start, p.t_start) for p in pairs] == [(0, 0), (1, 1), (2, 2)]


def test_align_dp_scores_and_moves():
    kw = dict(
        exact_match_score=3.0,
        combination_score_multiplier=1.5,
        gap_penalty=-1.5,
        max_combination_len=4,
        ignore_leading_char_diff=False,
    )
    pairs, score = TokenAligner._align_dp(["ab", "c"], ["a", "b", "c"], **kw)
    assert [(p.s_start, p.s_end, p.t_start, p.t_end) for p in pairs] == [(0, 1, 0, 2), (1, 2, 2, 3)]
    assert all(p.is_correct for p in pairs) and score == pytest.approx(1.5 * 2 + 3.0)
    # a combination longer than max_combination_len is not considered
    pairs, _ = TokenAligner._align_dp(["ab"], ["a", "b"], **{**kw, "max_combination_len": 1})
    assert not any(p.is_correct for p in pairs)
    # gaps: an extra student token pairs with nothing
    pairs, score = TokenAligner._align_dp(["x", "y"], ["y"], **kw)
    assert [(p.s_start, p.t_start, p.is_correct) for p in pairs] == [(0, -1, False), (1, 0, True)]
    assert score == pytest.approx(-1.5 + 3.0)
    # ignore_leading_char_diff: " y" matches "y"
    pairs, _ = TokenAligner._align_dp([" y"], ["y"], **{**kw, "ignore_leading_char_diff": True})
    assert [p.is_correct for p in pairs] == [True]
    assert TokenAligner._align_dp([], [], **kw) == ([], 0.0)


def test_no_anchor_lengths_is_the_dp_alone():
    aligner = TokenAligner(None, None)
    kw = dict(
        exact_match_score=3.0,
        combination_score_multiplier=1.5,
        gap_penalty=-1.5,
        max_combination_len=4,
        ignore_leading_char_diff=False,
    )
    s, t = ["a", "bc", "d"], ["ab", "cd"]
    assert aligner._align_with_anchors(s, t, (), **kw) == TokenAligner._align_dp(s, t, **kw)
    with pytest.raises(ValueError, match="anchor lengths"):
        aligner._align_with_anchors(s, t, (0,), **kw)


# --- with offsets (NeMo RL's offset-based align) --------------------------------------------------


def test_offsets_give_shardkits_exact_chunks():
    vocab = {0: "<pad>", 1: "Hello", 2: "\u0120world", 3: "!"}
    aligner = _aligner(vocab, vocab)
    ids = _ids([[1, 2, 3, 0, 0, 0], [1, 2, 3, 2, 3, 1]])
    offsets = torch.tensor(
        [
            [[0, 5], [5, 11], [11, 12], [0, 0], [0, 0], [0, 0]],
            [[0, 5], [5, 11], [11, 12], [12, 18], [18, 19], [19, 24]],
        ]
    )
    mask = _ids([[1, 1, 1, 0, 0, 0], [1] * 6])
    batch = aligner.align(
        ids,
        ids.clone(),
        student_offsets=offsets,
        teacher_offsets=offsets.clone(),
        student_attention_mask=mask,
        teacher_attention_mask=mask,
    )
    assert batch.student_chunk_id.tolist() == [[0, 1, 2, -1, -1, -1], [0, 1, 2, 3, 4, 5]]
    assert batch.pair_is_correct[1].tolist() == [True] * 6
    # a token straddling the other side's boundary: one chunk over both
    batch = aligner.align(
        _ids([[1, 2]]),
        _ids([[1]]),
        student_offsets=torch.tensor([[[0, 2], [2, 5]]]),
        teacher_offsets=torch.tensor([[[0, 5]]]),
    )
    assert batch.student_chunk_id.tolist() == [[0, 0]] and batch.teacher_chunk_id.tolist() == [[0]]


def test_bad_input_is_named():
    vocab = {1: "a"}
    aligner = _aligner(vocab, vocab)
    with pytest.raises(ValueError, match="1 student samples but 2 teacher"):
        aligner.align(_ids([[1]]), _ids([[1], [1]]))
    with pytest.raises(ValueError, match="both student_offsets and teacher_offsets"):
        aligner.align(_ids([[1]]), _ids([[1]]), student_offsets=torch.zeros(1, 1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="student_attention_mask has shape"):
        aligner.align(_ids([[1]]), _ids([[1]]), student_attention_mask=_ids([[1, 1]]))
    with pytest.raises(ValueError, match="max_comb_len"):
        TokenAligner(None, None, max_comb_len=0)


# --- the string front equals the exact offset aligner on real tokenizers --------------------------

TEXTS = CORPUS + ["", "x", "  leading and trailing  ", "\u00e9\u00e9\u00e9 \U0001f600\U0001f600"]


@pytest.mark.parametrize("pair", [(0, 1), (0, 2), (1, 2)])
def test_token_strings_give_the_offset_aligners_chunks(pair):
    toks = tokenizers()
    student, teacher = toks[pair[0]], toks[pair[1]]
    aligner = TokenAligner(None, None)
    for text in TEXTS:
        s, t = student.encode(text), teacher.encode(text)
        got = aligner._align_single(
            [student.id_to_token(i) for i in s.ids], [teacher.id_to_token(i) for i in t.ids]
        )
        want = align_offsets(s.offsets, t.offsets)
        assert [(p.s_start, p.s_end, p.t_start, p.t_end, p.is_correct) for p in got] == [
            (p.student_start, p.student_end, p.teacher_start, p.teacher_end, p.is_correct) for p in want
        ], text


def test_module_exposes_the_names():
    for name in ("TokenAligner", "AlignmentPair", "_canonicalize_sequence"):
        assert hasattr(na, name)


def test_empty_inputs_are_normal():
    vocab = {0: "a"}
    aligner = _aligner(vocab, vocab)
    batch = aligner.align(torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 2, dtype=torch.long))
    assert batch.student_chunk_id.shape == (0, 3) and batch.num_chunks.shape == (0,)
    batch = aligner.align(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long))
    assert batch.num_chunks.tolist() == [0, 0] and batch.pair_valid.shape == (2, 1)
    ids, none = torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2)
    batch = aligner.align(ids, ids, student_attention_mask=none, teacher_attention_mask=none)
    assert batch.num_chunks.tolist() == [0] and (batch.student_chunk_id == -1).all()
    # one side empty: every student token is a one-sided (invalid) pair
    batch = aligner.align(ids, torch.zeros(1, 0, dtype=torch.long))
    assert batch.student_chunk_id.tolist() == [[0, 1]] and not batch.pair_is_correct.any()


def test_differing_texts_keep_every_token_once_in_order():
    """Real tokenizers on a text and an edited copy (insertions, deletions, substitutions): every token
    is in exactly one pair, in order, and a pair is correct exactly when its two texts are equal."""
    import random

    toks = tokenizers()
    aligner = TokenAligner(None, None)
    rng = random.Random(0)
    for _ in range(60):
        text = rng.choice(CORPUS)
        chars = list(text)
        for _ in range(rng.randint(1, 4)):
            op, p = rng.choice("ids"), rng.randrange(len(chars) + 1)
            if op == "i":
                chars.insert(p, rng.choice(["x", " ", "\u00e9", "\U0001f600"]))
            elif p < len(chars):
                if op == "d":
                    del chars[p]
                else:
                    chars[p] = rng.choice("qrs")
        student, teacher = toks[rng.randrange(3)], toks[rng.randrange(3)]
        s_tok = [student.id_to_token(i) for i in student.encode(text).ids]
        t_tok = [teacher.id_to_token(i) for i in teacher.encode("".join(chars)).ids]
        pairs = aligner._align_single(s_tok, t_tok)
        assert [q for p in pairs if p.s_start >= 0 for q in range(p.s_start, p.s_end)] == list(
            range(len(s_tok))
        )
        assert [q for p in pairs if p.t_start >= 0 for q in range(p.t_start, p.t_end)] == list(
            range(len(t_tok))
        )
        s_canon, s_map = _canonicalize_sequence(s_tok)
        t_canon, t_map = _canonicalize_sequence(t_tok)

        def text_of(canon, ranges, start, end):
            return "".join(c for c, (a, b) in zip(canon, ranges) if start <= a and b <= end)

        for p in pairs:
            s_txt = text_of(s_canon, s_map, p.s_start, p.s_end) if p.s_start >= 0 else ""
            t_txt = text_of(t_canon, t_map, p.t_start, p.t_end) if p.t_start >= 0 else ""
            assert p.is_correct == (bool(s_txt) and s_txt == t_txt)
