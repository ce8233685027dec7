"""NeMo RL's ``x_token.token_aligner`` names over shardkit's aligner (issue 28, item 3).

NeMo RL aligns token *strings* (no offsets) with a Needleman-Wunsch DP over canonicalized tokens;
shardkit aligns token *offsets* exactly (``shardkit.distill.aligner``). This module gives NeMo RL's
surface and reuses shardkit's pieces where the concept is the same:

- ``AlignmentPair``: NeMo RL's 7-field pair record (``s_tokens``, ``t_tokens``, ``s_start``, ``s_end``,
  ``t_start``, ``t_end``, ``is_correct``; ``-1`` start / end on an empty side).
- ``_canonicalize_sequence(tokens) -> (canon, canon_to_orig)``: the text each token stands for, with
  tokens that only together spell one UTF-8 character (a byte-level BPE splitting a multi-byte
  character, e.g. ``["ĠâĪ", "ĳ"]`` -> ``[" ∑"]``) merged; ``canon_to_orig[k]`` is the half-open range of
  original tokens canonical token ``k`` came from (rules: ``shardkit.distill.nemo_rl_canonical``).
- ``TokenAligner(student_tokenizer, teacher_tokenizer, projection_matrix_path=None, max_comb_len=4)``
  with ``align(student_ids, teacher_ids, *, student_attention_mask=None, teacher_attention_mask=None,
  student_offsets=None, teacher_offsets=None) -> AlignmentBatch`` (shardkit's ``AlignmentBatch``,
  the same seven fields). Without offsets: tokens (``convert_ids_to_tokens``) are canonicalized;
  where the two texts agree the chunks are shardkit's exact ones (``align_offsets`` on offsets
  derived from the canonical texts), and only the stretches where they disagree go through the DP
  (``_align_dp``). With offsets (NeMo RL's newer offset-based ``align``): ``align_offsets`` directly.
  Positions an attention mask marks as padding join no chunk.

Where NeMo RL's heuristic and this front disagree is listed in docs/distill.md ("NeMo RL's current
names").
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

from shardkit.distill.aligner import align_offsets, pack_alignment
from shardkit.distill.alignment_batch import AlignmentBatch
from shardkit.distill.nemo_rl_canonical import _canonicalize_sequence

Range = Tuple[int, int]
__all__ = ["AlignmentPair", "TokenAligner", "_canonicalize_sequence"]


@dataclass
class AlignmentPair:
    """One aligned span: tokens ``[s_start, s_end)`` of the student and ``[t_start, t_end)`` of the teacher.

    ``s_tokens`` / ``t_tokens``: the (canonical) token strings of the span. An empty side has
    ``start == end == -1``. ``is_correct``: both sides non-empty and their texts equal.
    """

    s_tokens: List[str]
    t_tokens: List[str]
    s_start: int
    s_end: int
    t_start: int
    t_end: int
    is_correct: bool = False


def _cumulative(texts: Sequence[str]) -> List[Range]:
    out, pos = [], 0
    for t in texts:
        out.append((pos, pos + len(t)))
        pos += len(t)
    return out


def _equal(a: str, b: str, ignore_leading_char_diff: bool) -> bool:
    if ignore_leading_char_diff:
        return a.removeprefix(" ") == b.removeprefix(" ")
    return a == b


def _pair(s_tokens, t_tokens, s_range: Optional[Range], t_range: Optional[Range]) -> AlignmentPair:
    s0, s1 = s_range if s_range is not None else (-1, -1)
    t0, t1 = t_range if t_range is not None else (-1, -1)
    s_txt, t_txt = "".join(s_tokens), "".join(t_tokens)
    return AlignmentPair(list(s_tokens), list(t_tokens), s0, s1, t0, t1, bool(s_txt) and s_txt == t_txt)


def _shared_coordinates(a: str, b: str, min_anchor: int):
    """Maps of character positions of ``a`` and ``b`` into one coordinate where equal stretches coincide.

    Equal blocks (``difflib``, at least ``min_anchor`` characters) share coordinates; a stretch
    where the texts differ becomes one interval ``[p, p + w)`` in which every position of either
    side maps to ``p`` as a token start and to ``p + w`` as a token end, so tokens touching it
    fall into one chunk. Returns ``(a_start, a_end, b_start, b_end)`` lists indexed by position.
    """
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    blocks: List[Tuple[bool, int, int, int, int]] = []
    for tag, i1, i2, j1, j2 in ops:
        equal = tag == "equal" and i2 - i1 >= min_anchor
        if blocks and not equal and not blocks[-1][0]:
            blocks[-1] = (False, blocks[-1][1], i2, blocks[-1][3], j2)
        else:
            blocks.append((equal, i1, i2, j1, j2))
    maps = [[0] * (len(a) + 1), [0] * (len(a) + 1), [0] * (len(b) + 1), [0] * (len(b) + 1)]
    p = 0
    for equal, i1, i2, j1, j2 in blocks:
        width = (i2 - i1) if equal else max(i2 - i1, j2 - j1)
        for lo, hi, start_map, end_map in ((i1, i2, maps[0], maps[1]), (j1, j2, maps[2], maps[3])):
            for x in range(lo, hi):  # x as a token start
                start_map[x] = p + (x - lo if equal else 0)
            for x in range(lo + 1, hi + 1):  # x as a token end
                end_map[x] = p + (x - lo if equal else width)
        p += width
    maps[0][len(a)] = maps[2][len(b)] = p
    return maps


class TokenAligner:
    """NeMo RL's ``TokenAligner`` surface (see the module doc).

    Args:
        student_tokenizer, teacher_tokenizer: objects with ``convert_ids_to_tokens(ids)`` (a Hugging
            Face tokenizer); their ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``, when
            present, make those ids pair by role whatever their spelling.
        projection_matrix_path: kept for callers (``self.projection_matrix_path``); not read here.
        max_comb_len: the longest span one token may match on the other side in the DP.
    """

    def __init__(
        self,
        student_tokenizer: Any,
        teacher_tokenizer: Any,
        projection_matrix_path: Optional[str] = None,
        max_comb_len: int = 4,
    ) -> None:
        if int(max_comb_len) < 1:
            raise ValueError(f"TokenAligner: max_comb_len must be >= 1, got {max_comb_len}")
        self.student_tokenizer = student_tokenizer
        self.teacher_tokenizer = teacher_tokenizer
        self.projection_matrix_path = projection_matrix_path
        self.max_combination_len = int(max_comb_len)

    # ------------------------------------------------------------------ batch entry point
    def align(
        self,
        student_ids: torch.Tensor,
        teacher_ids: torch.Tensor,
        *,
        student_attention_mask: Optional[torch.Tensor] = None,
        teacher_attention_mask: Optional[torch.Tensor] = None,
        student_offsets: Optional[torch.Tensor] = None,
        teacher_offsets: Optional[torch.Tensor] = None,
    ) -> AlignmentBatch:
        """Align ``student_ids [B, T_s]`` with ``teacher_ids [B, T_t]`` (int64) into an ``AlignmentBatch``.

        ``*_attention_mask [B, T]``: 0 marks padding, which joins no chunk (``chunk_id`` -1, not on
        the exact partition). ``student_offsets [B, T_s, 2]`` / ``teacher_offsets [B, T_t, 2]``: the
        tokens' ``(start, end)`` positions in the source text; both or neither.
        """
        if student_ids.dim() != 2 or teacher_ids.dim() != 2:
            raise ValueError(
                f"TokenAligner.align: expected [B, T] id tensors, got student {tuple(student_ids.shape)} "
                f"and teacher {tuple(teacher_ids.shape)}"
            )
        if student_ids.size(0) != teacher_ids.size(0):
            raise ValueError(
                f"TokenAligner.align: {student_ids.size(0)} student samples but "
                f"{teacher_ids.size(0)} teacher samples"
            )
        if (student_offsets is None) != (teacher_offsets is None):
            raise ValueError("TokenAligner.align: pass both student_offsets and teacher_offsets, or neither")
        b, t_s = student_ids.shape
        t_t = teacher_ids.size(1)
        s_keep = self._kept("student", student_attention_mask, student_ids)
        t_keep = self._kept("teacher", teacher_attention_mask, teacher_ids)
        per_sample = []
        for i in range(b):
            if student_offsets is not None:
                spans = self._offset_spans(
                    student_offsets, teacher_offsets, i, s_keep[i], t_keep[i], t_s, t_t
                )
            else:
                s_tok = self._tokens(self.student_tokenizer, student_ids[i], s_keep[i])
                t_tok = self._tokens(self.teacher_tokenizer, teacher_ids[i], t_keep[i])
                spans = [
                    (
                        [s_keep[i][q] for q in range(p.s_start, p.s_end)] if p.s_start >= 0 else [],
                        [t_keep[i][q] for q in range(p.t_start, p.t_end)] if p.t_start >= 0 else [],
                        p.is_correct,
                    )
                    for p in self._align_single(s_tok, t_tok)
                ]
            per_sample.append(spans)
        return pack_alignment(per_sample, student_length=t_s, teacher_length=t_t)

    @staticmethod
    def _kept(side: str, mask: Optional[torch.Tensor], ids: torch.Tensor) -> List[List[int]]:
        """Per sample, the positions that are real tokens (all of them without a mask)."""
        if mask is None:
            return [list(range(ids.size(1))) for _ in range(ids.size(0))]
        if tuple(mask.shape) != tuple(ids.shape):
            raise ValueError(
                f"TokenAligner.align: {side}_attention_mask has shape {tuple(mask.shape)}, "
                f"ids {tuple(ids.shape)}"
            )
        return [torch.nonzero(row != 0).flatten().tolist() for row in mask]

    @staticmethod
    def _tokens(tokenizer: Any, ids: torch.Tensor, keep: List[int]) -> List[str]:
        """Token strings of the kept positions; special ids become their role, so BOS pairs with BOS."""
        kept = [int(ids[q]) for q in keep]
        tokens = list(tokenizer.convert_ids_to_tokens(kept))
        roles = {}
        for role in ("pad", "eos", "bos"):  # later roles win when one id has several
            tid = getattr(tokenizer, f"{role}_token_id", None)
            if tid is not None:
                roles[int(tid)] = f"<{role}>"
        return [roles.get(q, tok) for q, tok in zip(kept, tokens)]

    @staticmethod
    def _offset_spans(s_offsets, t_offsets, i, s_keep, t_keep, t_s, t_t):
        """Exact pairs of sample ``i`` from offsets; padding gets zero width (no chunk)."""

        def rows(offsets, keep, length, side):
            if tuple(offsets.shape[1:]) != (length, 2):
                raise ValueError(
                    f"TokenAligner.align: {side}_offsets must be [B, {length}, 2], got {tuple(offsets.shape)}"
                )
            kept = set(keep)
            return [
                (int(a), int(e)) if q in kept else (int(a), int(a))
                for q, (a, e) in enumerate(offsets[i].tolist())
            ]

        pairs = align_offsets(
            rows(s_offsets, s_keep, t_s, "student"), rows(t_offsets, t_keep, t_t, "teacher")
        )
        return [
            (
                range(p.student_start, p.student_end) if p.student_start >= 0 else [],
                range(p.teacher_start, p.teacher_end) if p.teacher_start >= 0 else [],
                p.is_correct,
            )
            for p in pairs
        ]

    # ------------------------------------------------------------------ one sample
    def _align_single(
        self,
        student_tokens: List[str],
        teacher_tokens: List[str],
        exact_match_score: float = 3.0,
        combination_score_multiplier: float = 1.5,
        gap_penalty: float = -1.5,
        anchor_lengths: Tuple[int, ...] = (3,),
    ) -> List[AlignmentPair]:
        """Canonicalize, align, and map the spans back to the original token positions."""
        s_canon, s_map = _canonicalize_sequence(student_tokens)
        t_canon, t_map = _canonicalize_sequence(teacher_tokens)
        pairs, _ = self._align_with_anchors(
            s_canon,
            t_canon,
            anchor_lengths,
            exact_match_score=exact_match_score,
            combination_score_multiplier=combination_score_multiplier,
            gap_penalty=gap_penalty,
            max_combination_len=getattr(self, "max_combination_len", 4),
            ignore_leading_char_diff=False,
        )
        for p in pairs:  # canonical -> original token positions
            if p.s_start >= 0:
                p.s_start, p.s_end = s_map[p.s_start][0], s_map[p.s_end - 1][1]
            if p.t_start >= 0:
                p.t_start, p.t_end = t_map[p.t_start][0], t_map[p.t_end - 1][1]
        return pairs

    def _align_with_anchors(
        self,
        student_tokens: List[str],
        teacher_tokens: List[str],
        anchor_lengths: Tuple[int, ...] = (3,),
        *,
        exact_match_score: float,
        combination_score_multiplier: float,
        gap_penalty: float,
        max_combination_len: int,
        ignore_leading_char_diff: bool,
    ) -> Tuple[List[AlignmentPair], float]:
        """Exact chunks where the texts agree, ``_align_dp`` where they do not.

        The canonical texts are laid on one coordinate (equal stretches of at least
        ``min(anchor_lengths)`` characters are the anchors; ``anchor_lengths`` counts characters
        here, tokens in NeMo RL) and chunked by ``align_offsets``; each run of chunks whose texts
        differ is re-aligned token by token with ``_align_dp``. Empty ``anchor_lengths``: the DP
        alone over the whole sequences. Returns the pairs (canonical positions) and the score:
        ``exact_match_score`` per exact chunk plus the DP scores of the re-aligned runs.
        """
        dp = dict(
            exact_match_score=exact_match_score,
            combination_score_multiplier=combination_score_multiplier,
            gap_penalty=gap_penalty,
            max_combination_len=max_combination_len,
            ignore_leading_char_diff=ignore_leading_char_diff,
        )
        if not anchor_lengths:
            return self._align_dp(student_tokens, teacher_tokens, **dp)
        min_anchor = min(int(n) for n in anchor_lengths)
        if min_anchor < 1:
            raise ValueError(f"_align_with_anchors: anchor lengths must be >= 1, got {anchor_lengths}")
        s_off, t_off = _cumulative(student_tokens), _cumulative(teacher_tokens)
        a, b = "".join(student_tokens), "".join(teacher_tokens)
        if a != b:
            a_start, a_end, b_start, b_end = _shared_coordinates(a, b, min_anchor)
            s_off = [(a_start[x], a_end[y]) if y > x else (a_start[x],) * 2 for x, y in s_off]
            t_off = [(b_start[x], b_end[y]) if y > x else (b_start[x],) * 2 for x, y in t_off]
        out: List[AlignmentPair] = []
        score = 0.0
        run: List[List[int]] = [[], []]  # tokens of consecutive chunks whose texts differ

        def flush():
            nonlocal score
            if not run[0] and not run[1]:
                return
            s0, t0 = (run[0][0] if run[0] else 0), (run[1][0] if run[1] else 0)
            sub, sub_score = self._align_dp(
                [student_tokens[q] for q in run[0]], [teacher_tokens[q] for q in run[1]], **dp
            )
            for p in sub:
                p.s_start, p.s_end = (p.s_start + s0, p.s_end + s0) if p.s_start >= 0 else (-1, -1)
                p.t_start, p.t_end = (p.t_start + t0, p.t_end + t0) if p.t_start >= 0 else (-1, -1)
            out.extend(sub)
            score += sub_score
            run[0], run[1] = [], []

        for c in align_offsets(s_off, t_off):
            s_idx = list(range(c.student_start, c.student_end)) if c.student_start >= 0 else []
            t_idx = list(range(c.teacher_start, c.teacher_end)) if c.teacher_start >= 0 else []
            p = _pair(
                [student_tokens[q] for q in s_idx],
                [teacher_tokens[q] for q in t_idx],
                (s_idx[0], s_idx[-1] + 1) if s_idx else None,
                (t_idx[0], t_idx[-1] + 1) if t_idx else None,
            )
            if p.is_correct:
                flush()
                out.append(p)
                score += exact_match_score
            else:
                run[0].extend(s_idx)
                run[1].extend(t_idx)
        flush()
        return out, score

    @staticmethod
    def _align_dp(
        student_tokens: List[str],
        teacher_tokens: List[str],
        *,
        exact_match_score: float,
        combination_score_multiplier: float,
        gap_penalty: float,
        max_combination_len: int,
        ignore_leading_char_diff: bool,
    ) -> Tuple[List[AlignmentPair], float]:
        """Needleman-Wunsch over token strings, with one token matching up to ``max_combination_len``.

        Moves and scores: one-to-one (``+exact_match_score`` when the strings are equal, else
        ``-exact_match_score``), a gap on either side (``gap_penalty`` per token), one token equal
        to the concatenation of ``k`` (2..``max_combination_len``) tokens of the other side
        (``combination_score_multiplier * k``). Ties prefer one-to-one, then a student gap, then a
        teacher gap, then combinations. ``ignore_leading_char_diff``: strings compare without one
        leading space. Returns the pairs in order (positions into the inputs) and the best score.
        """
        n, m = len(student_tokens), len(teacher_tokens)
        eq = lambda x, y: _equal(x, y, ignore_leading_char_diff)  # noqa: E731
        score = [[0.0] * (m + 1) for _ in range(n + 1)]
        move: List[List[Tuple[int, int]]] = [[(0, 0)] * (m + 1) for _ in range(n + 1)]
        for i in range(1, n + 1):
            score[i][0], move[i][0] = score[i - 1][0] + gap_penalty, (1, 0)
        for j in range(1, m + 1):
            score[0][j], move[0][j] = score[0][j - 1] + gap_penalty, (0, 1)
        kmax = max(1, int(max_combination_len))
        for i in range(1, n + 1):
            s_tok = student_tokens[i - 1]
            for j in range(1, m + 1):
                t_tok = teacher_tokens[j - 1]
                best = score[i - 1][j - 1] + (exact_match_score if eq(s_tok, t_tok) else -exact_match_score)
                step = (1, 1)
                for cand, st in (
                    (score[i - 1][j] + gap_penalty, (1, 0)),
                    (score[i][j - 1] + gap_penalty, (0, 1)),
                ):
                    if cand > best:
                        best, step = cand, st
                for k in range(2, min(j, kmax) + 1):  # one student token = k teacher tokens
                    if eq(s_tok, "".join(teacher_tokens[j - k : j])):
                        cand = score[i - 1][j - k] + combination_score_multiplier * k
                        if cand > best:
                            best, step = cand, (1, k)
                for k in range(2, min(i, kmax) + 1):  # k student tokens = one teacher token
                    if eq(t_tok, "".join(student_tokens[i - k : i])):
                        cand = score[i - k][j - 1] + combination_score_multiplier * k
                        if cand > best:
                            best, step = cand, (k, 1)
                score[i][j], move[i][j] = best, step
        pairs: List[AlignmentPair] = []
        i, j = n, m
        while i > 0 or j > 0:
            di, dj = move[i][j]
            s_tokens, t_tokens = student_tokens[i - di : i], teacher_tokens[j - dj : j]
            p = _pair(s_tokens, t_tokens, (i - di, i) if di else None, (j - dj, j) if dj else None)
            if di and dj and ignore_leading_char_diff:
                p.is_correct = eq("".join(s_tokens), "".join(t_tokens)) and bool(s_tokens)
            pairs.append(p)
            i, j = i - di, j - dj
        pairs.reverse()
        return pairs, float(score[n][m])
