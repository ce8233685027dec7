"""Token aligner: chunk pairs of two tokenizations of the same text, derived from character offsets.

A chunk pair is a student token span and a teacher token span that cover the same stretch of text.
The pairs come from the tokens' offsets (``[start, end)`` character or byte positions into the text,
as tokenizers report them), not from comparing token strings, so they are exact by construction:

- a *boundary* is a position that ends some token (on either side) and lies strictly inside no token
  of either side;
- the text between consecutive boundaries is one chunk; each token belongs to the chunk that
  contains it (no token straddles a boundary, so that chunk is unique);
- chunks are as fine as the two tokenizations allow: where both sides put a token boundary, a chunk
  ends. Zero-width tokens (special tokens such as BOS, offsets ``(p, p)``) belong to no chunk.

A pair's texts are equal (``is_correct``) when both sides are non-empty and cover exactly the same
characters; they can differ only where a tokenizer leaves characters uncovered (e.g. a whitespace
pre-tokenizer that drops spaces). Several tokens may share offsets (a byte-level tokenizer splitting
one multi-byte character); they then stay in one chunk.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from shardkit.distill.alignment_batch import AlignmentBatch

Offsets = Sequence[Tuple[int, int]]
Encode = Callable[[str], Tuple[Sequence[int], Offsets]]


@dataclass(frozen=True)
class ChunkPair:
    """One aligned chunk: token spans ``[start, end)`` on each side (``-1, -1`` when that side is empty).

    ``char_start`` / ``char_end``: the stretch of text the chunk covers. ``is_correct``: both sides
    non-empty and covering exactly the same characters.
    """

    student_start: int
    student_end: int
    teacher_start: int
    teacher_end: int
    char_start: int
    char_end: int
    is_correct: bool


def _check_offsets(name: str, offsets: Offsets) -> List[Tuple[int, int]]:
    out = []
    last_start = 0
    for i, pair in enumerate(offsets):
        start, end = int(pair[0]), int(pair[1])
        if start < 0 or end < start:
            raise ValueError(f"align_offsets: {name} token {i} has invalid offsets ({start}, {end})")
        if end > start:
            if start < last_start:
                raise ValueError(
                    f"align_offsets: {name} offsets must have non-decreasing starts; token {i} starts at "
                    f"{start} after a token starting at {last_start}"
                )
            last_start = start
        out.append((start, end))
    return out


def _straddled(offsets: List[Tuple[int, int]], length: int) -> List[bool]:
    """``inside[p]``: some token covers both ``p - 1`` and ``p`` (a cut at ``p`` would split it)."""
    diff = [0] * (length + 2)
    for start, end in offsets:
        if end - start >= 2:
            diff[start + 1] += 1
            diff[end] -= 1
    inside, running = [], 0
    for p in range(length + 1):
        running += diff[p]
        inside.append(running > 0)
    return inside


def _covered(offsets: List[Tuple[int, int]], tokens: List[int]) -> List[Tuple[int, int]]:
    """Merged character intervals covered by ``tokens``."""
    merged: List[Tuple[int, int]] = []
    for start, end in sorted(offsets[i] for i in tokens):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def align_offsets(student_offsets: Offsets, teacher_offsets: Offsets) -> List[ChunkPair]:
    """Chunk pairs of two tokenizations of one text, from their token offsets (see the module doc).

    Args:
        student_offsets, teacher_offsets: per token ``(start, end)`` positions into the same text,
            starts non-decreasing over the tokens of non-zero width.
    Returns:
        The chunk pairs in text order. Token spans are contiguous index ranges; every token of
        non-zero width is in exactly one pair.
    """
    s_off = _check_offsets("student", student_offsets)
    t_off = _check_offsets("teacher", teacher_offsets)
    length = max([e for _, e in s_off] + [e for _, e in t_off] + [0])
    s_inside, t_inside = _straddled(s_off, length), _straddled(t_off, length)
    ends = {e for s, e in s_off if e > s} | {e for s, e in t_off if e > s}
    bounds = sorted(p for p in ends if not s_inside[p] and not t_inside[p])

    def group(offsets: List[Tuple[int, int]]) -> dict:
        chunks: dict = {}
        for i, (start, end) in enumerate(offsets):
            if end > start:
                chunks.setdefault(bisect.bisect_left(bounds, end), []).append(i)
        return chunks

    s_groups, t_groups = group(s_off), group(t_off)
    pairs = []
    for k in sorted(set(s_groups) | set(t_groups)):
        s_tok, t_tok = s_groups.get(k, []), t_groups.get(k, [])
        for name, toks in (("student", s_tok), ("teacher", t_tok)):
            if toks and toks[-1] - toks[0] + 1 != len(toks):
                raise ValueError(
                    f"align_offsets: {name} tokens {toks[0]}..{toks[-1]} of one chunk are interleaved with "
                    f"tokens of another (offsets out of order)"
                )
        char_start = min([s_off[i][0] for i in s_tok] + [t_off[i][0] for i in t_tok])
        correct = bool(s_tok) and bool(t_tok) and _covered(s_off, s_tok) == _covered(t_off, t_tok)
        pairs.append(
            ChunkPair(
                s_tok[0] if s_tok else -1,
                s_tok[-1] + 1 if s_tok else -1,
                t_tok[0] if t_tok else -1,
                t_tok[-1] + 1 if t_tok else -1,
                char_start,
                bounds[k],
                correct,
            )
        )
    return pairs


def _truncate_to_common_text(
    s_off: List[Tuple[int, int]], t_off: List[Tuple[int, int]], s_len: int, t_len: int
) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    """Keep the tokens that fit, then only those ending within the text both sides still cover.

    Dropped tokens get zero-width offsets, so they join no chunk: a truncated sequence must not
    pair its last tokens with a longer stretch of text on the other side.
    """
    s_off, t_off = s_off[:s_len], t_off[:t_len]
    cut = min(max([e for _, e in s_off] + [0]), max([e for _, e in t_off] + [0]))
    return [(s, e) if e <= cut else (s, s) for s, e in s_off], [
        (s, e) if e <= cut else (s, s) for s, e in t_off
    ]


PairTokens = Tuple[Sequence[int], Sequence[int], bool]


def pack_alignment(
    per_sample: Sequence[Sequence[PairTokens]], *, student_length: int, teacher_length: int
) -> AlignmentBatch:
    """Pack each sample's chunk pairs into a dense-padded ``AlignmentBatch``.

    Args:
        per_sample: per sample, its pairs in order as ``(student token positions, teacher token
            positions, is_correct)``; a side may be empty. Pair ``k`` of a sample is chunk ``k``.
        student_length, teacher_length: ``T_s`` / ``T_t`` of the token tensors; every position must
            lie in ``[0, T)`` (``ValueError`` otherwise).
    Returns:
        The tensors (``C = max(1, max pairs per sample)``); a token is on the exact partition when
        its pair is correct and has one token on each side.
    """
    b = len(per_sample)
    c = max([len(p) for p in per_sample] + [1])
    pair_valid = torch.zeros(b, c, dtype=torch.bool)
    pair_is_correct = torch.zeros(b, c, dtype=torch.bool)
    s_exact = torch.zeros(b, student_length, dtype=torch.bool)
    t_exact = torch.zeros(b, teacher_length, dtype=torch.bool)
    s_cid = torch.full((b, student_length), -1, dtype=torch.long)
    t_cid = torch.full((b, teacher_length), -1, dtype=torch.long)
    num_chunks = torch.zeros(b, dtype=torch.long)
    for i, pairs in enumerate(per_sample):
        num_chunks[i] = len(pairs)
        for k, (s_pos, t_pos, correct) in enumerate(pairs):
            for side, pos, length in (("student", s_pos, student_length), ("teacher", t_pos, teacher_length)):
                if any(not 0 <= int(q) < length for q in pos):
                    raise ValueError(
                        f"pack_alignment: sample {i} pair {k} has {side} positions outside [0, {length}): "
                        f"{list(pos)[:8]}"
                    )
            pair_valid[i, k] = True
            pair_is_correct[i, k] = bool(correct)
            s_idx = torch.as_tensor(list(s_pos), dtype=torch.long)
            t_idx = torch.as_tensor(list(t_pos), dtype=torch.long)
            s_cid[i, s_idx] = k
            t_cid[i, t_idx] = k
            if correct and len(s_idx) == 1 and len(t_idx) == 1:
                s_exact[i, s_idx] = True
                t_exact[i, t_idx] = True
    return AlignmentBatch(pair_valid, pair_is_correct, s_exact, t_exact, s_cid, t_cid, num_chunks)


def alignment_batch_from_offsets(
    student_offsets: Sequence[Offsets],
    teacher_offsets: Sequence[Offsets],
    *,
    student_length: int,
    teacher_length: int,
) -> Tuple[AlignmentBatch, List[List[ChunkPair]]]:
    """Align a batch and pack it into a dense-padded ``AlignmentBatch``.

    Args:
        student_offsets, teacher_offsets: per sample, the token offsets of each side.
        student_length, teacher_length: ``T_s`` / ``T_t`` of the padded token tensors. Longer
            samples are truncated, and then cut to the text both sides still cover.
    Returns:
        ``(batch, pairs)``: the tensors (``chunk_id`` per *token*, -1 for padding, zero-width and
        truncated tokens) and each sample's chunk pairs. ``C = max(1, max pairs per sample)``.
    """
    if len(student_offsets) != len(teacher_offsets):
        raise ValueError(
            f"alignment_batch_from_offsets: {len(student_offsets)} student samples but "
            f"{len(teacher_offsets)} teacher samples"
        )
    per_sample = []
    for s_raw, t_raw in zip(student_offsets, teacher_offsets):
        s_off, t_off = _truncate_to_common_text(
            _check_offsets("student", s_raw), _check_offsets("teacher", t_raw), student_length, teacher_length
        )
        per_sample.append(align_offsets(s_off, t_off))
    spans = [
        [
            (
                range(p.student_start, p.student_end) if p.student_start >= 0 else range(0),
                range(p.teacher_start, p.teacher_end) if p.teacher_start >= 0 else range(0),
                p.is_correct,
            )
            for p in pairs
        ]
        for pairs in per_sample
    ]
    batch = pack_alignment(spans, student_length=student_length, teacher_length=teacher_length)
    return batch, per_sample


@dataclass
class AlignedBatch:
    """What ``TokenAligner`` returns: padded token ids of both sides, their masks, the alignment.

    ``student_ids [B, T_s]`` / ``teacher_ids [B, T_t]`` int64 (padding: the pad id),
    ``student_mask`` / ``teacher_mask`` bool (True on real tokens), ``alignment``, and ``pairs`` (each
    sample's ``ChunkPair`` list, for inspection).
    """

    student_ids: torch.Tensor
    teacher_ids: torch.Tensor
    student_mask: torch.Tensor
    teacher_mask: torch.Tensor
    alignment: AlignmentBatch
    pairs: List[List[ChunkPair]]


class TokenAligner:
    """Tokenize texts with both tokenizers and align them.

    Args:
        student_encode, teacher_encode: ``text -> (token ids, offsets)``; with the ``tokenizers``
            package: ``lambda text: (e := tok.encode(text)).ids, e.offsets``. Any tokenizer that reports
            offsets works; the aligner itself depends on torch only.
        student_pad_id, teacher_pad_id: the id written at padding positions.
    """

    def __init__(
        self,
        student_encode: Encode,
        teacher_encode: Encode,
        *,
        student_pad_id: int = 0,
        teacher_pad_id: int = 0,
    ) -> None:
        self.student_encode = student_encode
        self.teacher_encode = teacher_encode
        self.student_pad_id = int(student_pad_id)
        self.teacher_pad_id = int(teacher_pad_id)

    def __call__(
        self,
        texts: Sequence[str],
        *,
        student_length: Optional[int] = None,
        teacher_length: Optional[int] = None,
    ) -> AlignedBatch:
        """Tokenize and align ``texts``; lengths default to the longest sample of each side."""
        s_enc = [self.student_encode(t) for t in texts]
        t_enc = [self.teacher_encode(t) for t in texts]
        for side, enc in (("student", s_enc), ("teacher", t_enc)):
            for i, (ids, offsets) in enumerate(enc):
                if len(ids) != len(offsets):
                    raise ValueError(
                        f"TokenAligner: {side} sample {i} has {len(ids)} ids but {len(offsets)} offsets"
                    )
        s_len = student_length if student_length is not None else max([len(e[0]) for e in s_enc] + [1])
        t_len = teacher_length if teacher_length is not None else max([len(e[0]) for e in t_enc] + [1])
        alignment, pairs = alignment_batch_from_offsets(
            [e[1] for e in s_enc], [e[1] for e in t_enc], student_length=s_len, teacher_length=t_len
        )

        def pack(enc, length, pad):
            ids = torch.full((len(enc), length), pad, dtype=torch.long)
            mask = torch.zeros(len(enc), length, dtype=torch.bool)
            for i, (tok, _) in enumerate(enc):
                n = min(len(tok), length)
                ids[i, :n] = torch.tensor(list(tok[:n]), dtype=torch.long)
                mask[i, :n] = True
            return ids, mask

        s_ids, s_mask = pack(s_enc, s_len, self.student_pad_id)
        t_ids, t_mask = pack(t_enc, t_len, self.teacher_pad_id)
        return AlignedBatch(s_ids, t_ids, s_mask, t_mask, alignment, pairs)
