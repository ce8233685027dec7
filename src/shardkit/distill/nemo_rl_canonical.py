"""NeMo RL's ``_canonicalize_sequence``: the text each token stands for, split characters merged.

Per token, in order: GPT-2 byte-level text (every character in the byte table of
``shardkit.distill.projection_builder``, e.g. ``Ġ`` = space, ``Ċ`` = newline) is decoded as bytes,
merging with the following byte-level tokens until the bytes are valid UTF-8 (at most 4 more bytes);
SentencePiece byte tokens ``<0xAB>`` likewise; anything else is text, with ``▁`` and a leading ``Ġ``
read as a space. A byte run that never decodes stays as text, token by token (e.g. a literal ``é``).
Used by ``shardkit.distill.nemo_rl_aligner``.
"""

from __future__ import annotations

import re
from typing import List, Optional, Sequence, Tuple

from shardkit.distill.projection_builder import _BYTE_LEVEL

Range = Tuple[int, int]
_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_MAX_UTF8 = 4


def _token_bytes(token: str) -> Optional[bytes]:
    """The bytes a byte-level (GPT-2 table) or SentencePiece byte token stands for; None for text."""
    m = _SP_BYTE.match(token)
    if m:
        return bytes([int(m.group(1), 16)])
    if token and all(c in _BYTE_LEVEL for c in token):
        return bytes(_BYTE_LEVEL[c] for c in token)
    return None


def _as_text(token: str) -> str:
    """A token that is not byte-level: SentencePiece's ``▁`` and a leading ``Ġ`` are spaces."""
    if token.startswith("\u0120"):
        token = " " + token[1:]
    return token.replace("\u2581", " ")


def _decode(data: bytes) -> Optional[str]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _canonicalize_sequence(seq: Sequence[str]) -> Tuple[List[str], List[Range]]:
    """``(canon, canon_to_orig)``: each canonical token's text and the original tokens it spans.

    The ranges are non-overlapping, increasing and cover ``range(len(seq))``; a run of tokens
    is merged only when its tokens are byte tokens that decode to valid UTF-8 together and not
    alone (see the module doc), so clean input maps one to one.
    """
    raw = [_token_bytes(t) for t in seq]
    canon: List[str] = []
    ranges: List[Range] = []
    i = 0
    while i < len(seq):
        data = raw[i]
        if data is None:
            canon.append(_as_text(seq[i]))
            ranges.append((i, i + 1))
            i += 1
            continue
        text, end = _decode(data), i + 1
        if text is None:
            # an incomplete UTF-8 sequence: extend with the next byte tokens until it decodes
            joined, j = data, i + 1
            while j < len(seq) and raw[j] is not None and len(joined) + len(raw[j]) <= len(data) + _MAX_UTF8:
                joined += raw[j]
                j += 1
                text = _decode(joined)
                if text is not None:
                    end = j
                    break
        if text is None:
            text = _as_text(seq[i])  # never decodes: the token is plain text (e.g. a literal "é")
        canon.append(text)
        ranges.append((i, end))
        i = end
    return canon, ranges
