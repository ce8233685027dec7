"""Build a student-to-teacher projection from two vocabularies, and write it in either file format.

Tokens are compared by their *canonical* form, the bytes of text they stand for, so that the two
tokenizers' spellings do not matter:

- ``"byte_level"`` (GPT-2 style): each character is one byte through the byte-to-unicode table
  (``Ġ`` is a space, ``Ċ`` a newline, ...); a token with a character outside the table is UTF-8 text;
- ``"sentencepiece"``: ``▁`` is a space, ``<0xAB>`` is the byte 0xAB, anything else UTF-8 text;
- ``"plain"``: the token string's UTF-8 bytes.

Special tokens (given per side) are matched by their exact string only, never by bytes.

A student token maps *exactly* when one teacher token has the same canonical bytes (likelihood 1.0,
no second teacher token). Otherwise its bytes are split greedily (longest match first) into teacher
tokens, and the row spreads weight ``count / n`` over the distinct teacher tokens of that split of
``n`` pieces (*multi*). When the greedy split gets stuck (no teacher token matches at some position;
with a byte-complete teacher vocabulary this never happens) it maps to *none*.
Among teacher tokens with equal bytes the lowest id is used.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

Vocab = Union[Sequence[str], Mapping[str, int]]
SCHEMES = ("byte_level", "sentencepiece", "plain")


def _byte_level_table() -> Dict[str, int]:
    """GPT-2's reversible byte <-> printable-unicode table, inverted: character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_table()
_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def canonical_token(token: str, scheme: str) -> bytes:
    """The bytes of text a (non-special) token stands for under ``scheme`` (see the module doc)."""
    if scheme == "byte_level":
        if all(c in _BYTE_LEVEL for c in token):
            return bytes(_BYTE_LEVEL[c] for c in token)
        return token.encode("utf-8")
    if scheme == "sentencepiece":
        m = _SP_BYTE.match(token)
        if m:
            return bytes([int(m.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8")
    if scheme == "plain":
        return token.encode("utf-8")
    raise ValueError(f"unknown tokenizer scheme {scheme!r}; expected one of {SCHEMES}")


def _as_list(vocab: Vocab, side: str) -> List[str]:
    if isinstance(vocab, Mapping):
        size = max(vocab.values(), default=-1) + 1
        tokens: List[Optional[str]] = [None] * size
        for tok, i in vocab.items():
            if tokens[i] is not None:
                raise ValueError(f"{side} vocabulary maps both {tokens[i]!r} and {tok!r} to id {i}")
            tokens[i] = tok
        missing = [i for i, t in enumerate(tokens) if t is None]
        if missing:
            raise ValueError(f"{side} vocabulary has no token for ids {missing[:10]} (of {len(missing)})")
        return tokens  # type: ignore[return-value]
    return list(vocab)


@dataclass
class CoverageReport:
    """How the student vocabulary maps: ``exact + multi + none == student_vocab_size``.

    ``none_ids``: the student ids that map to nothing (at most the first 100).
    """

    student_vocab_size: int
    teacher_vocab_size: int
    exact: int
    multi: int
    none: int
    none_ids: List[int] = field(default_factory=list)

    def __str__(self) -> str:
        n = max(self.student_vocab_size, 1)
        return (
            f"{self.student_vocab_size} student tokens -> {self.teacher_vocab_size} teacher tokens: "
            f"{self.exact} exact ({100 * self.exact / n:.1f}%), {self.multi} to several "
            f"({100 * self.multi / n:.1f}%), {self.none} to none ({100 * self.none / n:.1f}%)"
        )


@dataclass
class Projection:
    """A built projection: ``rows[s]`` is student token ``s``'s list of ``(teacher id, weight)``."""

    rows: List[List[Tuple[int, float]]]
    counts: Dict[Tuple[int, int], int]
    report: CoverageReport

    def topk_arrays(self, top_k: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(indices LongTensor[V_s, k], likelihoods FloatTensor[V_s, k])``, unused slots ``-1`` / 0.

        ``k`` defaults to the longest row; rows longer than ``top_k`` keep their ``top_k`` heaviest
        teacher tokens (ties: first in the split), renormalized to sum to 1.
        """
        k = max([len(r) for r in self.rows] + [1]) if top_k is None else int(top_k)
        if k < 1:
            raise ValueError(f"top_k must be >= 1, got {k}")
        v_s = len(self.rows)
        indices = torch.full((v_s, k), -1, dtype=torch.long)
        likelihoods = torch.zeros(v_s, k, dtype=torch.float32)
        for s, row in enumerate(self.rows):
            kept = sorted(row, key=lambda tw: -tw[1])[:k]  # sorted() is stable: ties stay in split order
            total = sum(w for _, w in kept)
            for j, (t, w) in enumerate(kept):
                indices[s, j] = t
                likelihoods[s, j] = w / total
        return indices, likelihoods

    def save(
        self, path: Union[str, os.PathLike[str]], *, format: str = "topk", top_k: Optional[int] = None
    ) -> None:
        """Write the projection file: ``format="topk"`` (dense) or ``"sparse"`` (``{(s, t): count}``)."""
        if format == "topk":
            indices, likelihoods = self.topk_arrays(top_k)
            torch.save({"indices": indices, "likelihoods": likelihoods}, path)
        elif format == "sparse":
            torch.save(dict(self.counts), path)
        else:
            raise ValueError(f"unknown projection file format {format!r}; expected 'topk' or 'sparse'")


def build_projection(
    student_vocab: Vocab,
    teacher_vocab: Vocab,
    *,
    student_scheme: str,
    teacher_scheme: str,
    student_special: Iterable[str] = (),
    teacher_special: Iterable[str] = (),
) -> Projection:
    """Map every student token to teacher tokens (see the module doc for the rules).

    Args:
        student_vocab, teacher_vocab: the token strings by id, as a list or a ``{token: id}`` mapping
            (e.g. ``tokenizer.get_vocab()``); ids must be ``0..V-1`` without gaps.
        student_scheme, teacher_scheme: ``"byte_level"``, ``"sentencepiece"`` or ``"plain"``.
        student_special, teacher_special: the special token strings of each side.
    """
    s_tokens, t_tokens = _as_list(student_vocab, "student"), _as_list(teacher_vocab, "teacher")
    s_special, t_special = set(student_special), set(teacher_special)
    by_bytes: Dict[bytes, int] = {}
    special_ids: Dict[str, int] = {}
    for t, tok in enumerate(t_tokens):
        if tok in t_special:
            special_ids.setdefault(tok, t)
        else:
            canon = canonical_token(tok, teacher_scheme)
            if canon:
                by_bytes.setdefault(canon, t)
    longest = max((len(b) for b in by_bytes), default=0)
    rows: List[List[Tuple[int, float]]] = []
    counts: Dict[Tuple[int, int], int] = {}
    exact = multi = 0
    none_ids: List[int] = []
    for s, tok in enumerate(s_tokens):
        if tok in s_special:
            pieces = [special_ids[tok]] if tok in special_ids else []
        else:
            pieces = _split(canonical_token(tok, student_scheme), by_bytes, longest)
        if not pieces:
            rows.append([])
            none_ids.append(s)
            continue
        exact += len(pieces) == 1
        multi += len(pieces) > 1
        row: Dict[int, int] = {}
        for t in pieces:
            row[t] = row.get(t, 0) + 1
            counts[(s, t)] = counts.get((s, t), 0) + 1
        rows.append([(t, c / len(pieces)) for t, c in row.items()])
    report = CoverageReport(len(s_tokens), len(t_tokens), exact, multi, len(none_ids), none_ids[:100])
    return Projection(rows, counts, report)


def _split(data: bytes, by_bytes: Mapping[bytes, int], longest: int) -> List[int]:
    """Greedy longest-match split of ``data`` into teacher tokens; ``[]`` when impossible or empty."""
    pieces, i = [], 0
    while i < len(data):
        for n in range(min(longest, len(data) - i), 0, -1):
            t = by_bytes.get(data[i : i + n])
            if t is not None:
                pieces.append(t)
                i += n
                break
        else:
            return []
    return pieces
