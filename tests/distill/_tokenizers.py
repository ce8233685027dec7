"""Small real tokenizers trained on the fly (the ``tokenizers`` package, a dev dependency)."""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = "<|endoftext|>"

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A distilled student learns from its teacher, one chunk at a time.",
    "Tokenizers disagree: 'unbelievable' may be un-believ-able or unbeliev-able.",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve r\u00e9sum\u00e9s"
    " and \u4e2d\u6587 text \U0001f600 too.",
    "Numbers like 12345 and 3.14159 are split differently by different vocabularies.",
    "def forward(self, x):\n    return self.head(x)  # code, with spaces\tand tabs",
    "the the the student student teacher teacher distillation distillation",
]


def _byte_level_bpe(vocab_size: int, corpus) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


@functools.cache
def tokenizers():
    """``(student, teacher, byte_level)``: two BPE tokenizers of different vocabularies and a byte one."""
    student = _byte_level_bpe(300, CORPUS)
    teacher = _byte_level_bpe(420, CORPUS[::-1] + [c.upper() for c in CORPUS])
    byte_level = _byte_level_bpe(257, CORPUS)  # 256 bytes + the special token: no merges
    return student, teacher, byte_level


def encoder(tok: Tokenizer):
    def encode(text: str):
        enc = tok.encode(text)
        return enc.ids, enc.offsets

    return encode
