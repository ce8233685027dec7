"""Cross-tokenizer distillation: a tiny teacher LM taught to a tiny student LM with another tokenizer.

    torchrun --nproc-per-node 2 examples/xtoken_distill.py --steps 30
    python examples/xtoken_distill.py --steps 30 --gold

Needs the ``tokenizers`` package (in shardkit's ``dev`` extra): the two byte-level BPE tokenizers
(different vocabulary sizes, so different merges) are trained on the fly on a generated corpus.

1. The teacher (a small GRU LM over the teacher's tokens) is trained with plain cross-entropy for
   ``--teacher-steps`` and frozen; every rank does this identically.
2. ``build_projection`` maps each student token to the teacher tokens spelling the same bytes and
   saves the projection file (rank 0 writes it to a temporary directory, the others wait at a
   barrier, then read it).
3. Each step, every rank takes its share of the global batch of texts, ``TokenAligner`` tokenizes
   them both ways and cuts them into chunk pairs covering the same text, and
   ``CrossTokenizerDistillationLoss`` compares the chunk-averaged distributions of the two models
   (projection KL, or with ``--gold`` the gold loss) plus the student's own cross-entropy. The loss
   is normalized by the valid chunks of the global batch (``dp_group``), so summing the ranks'
   gradients gives the global batch's gradient: data parallelism over any number of ranks.

Rank 0 prints the loss, the distillation term and the student's cross-entropy as it trains.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
from typing import List, Optional, Sequence

import torch
import torch._dynamo  # noqa: F401 - before init_process_group (torch.optim imports it later): docs/running.md
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.distill import (
    CrossTokenizerDistillationLoss,
    DistillationConfig,
    TokenAligner,
    build_projection,
)

SPECIAL = "<|endoftext|>"
WORDS = {
    "det": ["the", "a", "every", "one", "that"],
    "adj": ["quick", "lazy", "brown", "clever", "unbelievable", "tiny", "distilled", "sharded"],
    "noun": ["fox", "dog", "student", "teacher", "tokenizer", "model", "table", "graph"],
    "verb": ["jumps over", "learns from", "splits", "imitates", "reads", "shards"],
}


def corpus(n: int, seed: int) -> List[str]:
    """``n`` sentences ``det adj noun verb det adj noun.``: a language a tiny LM can learn."""
    rng = random.Random(seed)
    return [
        " ".join(
            rng.choice(WORDS[k]) for k in ("det", "adj", "noun", "verb", "det", "adj", "noun")
        ).capitalize()
        + "."
        for _ in range(n)
    ]


def train_tokenizer(vocab_size: int, texts: Sequence[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encoder(tok):
    """The ``(ids, offsets)`` function ``TokenAligner`` tokenizes with."""

    def encode(text: str):
        enc = tok.encode(text)
        return enc.ids, enc.offsets

    return encode


class GruLM(nn.Module):
    """Embedding, one GRU layer, output head: ``ids [B, T]`` -> logits ``[B, T, V]``."""

    def __init__(self, vocab: int, dim: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.gru = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.embed(ids))[0])


def train_teacher(tok, texts: List[str], args) -> GruLM:
    """The teacher trained on its own tokens with next-token cross-entropy, then frozen."""
    teacher = GruLM(tok.get_vocab_size(), args.dim, args.seed)
    optimizer = torch.optim.Adam(teacher.parameters(), lr=1e-2)
    rng = random.Random(args.seed)
    for _ in range(args.teacher_steps):
        encoded = [tok.encode(t).ids for t in rng.sample(texts, args.batch)]
        width = max(len(e) for e in encoded)
        ids = torch.tensor([e + [-100] * (width - len(e)) for e in encoded])
        logits = teacher(ids[:, :-1].clamp(min=0))
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return teacher.requires_grad_(False).eval()


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="student training steps")
    p.add_argument("--teacher-steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=8, help="texts per rank per step")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--student-vocab", type=int, default=360)
    p.add_argument("--teacher-vocab", type=int, default=300)
    p.add_argument("--gold", action="store_true", help="the gold loss instead of the projection KL")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def distill(args, workdir: str) -> List[dict]:
    """Train the teacher, build the projection, distil the student; the metrics of every step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    texts = corpus(400, args.seed)
    student_tok = train_tokenizer(args.student_vocab, texts[:200])
    teacher_tok = train_tokenizer(args.teacher_vocab, texts[200:])
    teacher = train_teacher(teacher_tok, texts, args)

    path = os.path.join(workdir, "projection.pt")
    if rank == 0:
        projection = build_projection(
            student_tok.get_vocab(),
            teacher_tok.get_vocab(),
            student_scheme="byte_level",
            teacher_scheme="byte_level",
            student_special=[SPECIAL],
            teacher_special=[SPECIAL],
        )
        projection.save(path)
        print(f"projection: {projection.report}")
    dist.barrier()  # the file is complete before any rank reads it

    config = DistillationConfig(
        projection_matrix_path=path,
        student_vocab_size=student_tok.get_vocab_size(),
        teacher_vocab_size=teacher_tok.get_vocab_size(),
        gold_loss=args.gold,
        xtoken_loss=args.gold,
        vocab_topk=64,
        uncommon_topk=64,
        ce_loss_scale=0.1,
    )
    loss_fn = CrossTokenizerDistillationLoss(config)
    # the student's vocabulary is not sharded: each rank is its own tensor-parallel group
    singles = [dist.new_group([r]) for r in range(world)]
    student = GruLM(student_tok.get_vocab_size(), args.dim, args.seed + 1)
    optimizer = torch.optim.Adam(student.parameters(), lr=args.lr)
    aligner = TokenAligner(encoder(student_tok), encoder(teacher_tok))
    rng = random.Random(args.seed + 2)  # the same global batches on every rank
    history = []
    for _ in range(args.steps):
        batch = rng.sample(texts, args.batch * world)[rank * args.batch : (rank + 1) * args.batch]
        aligned = aligner(batch)
        with torch.no_grad():
            teacher_logits = teacher(aligned.teacher_ids)
        data = {
            "input_ids": aligned.student_ids,
            "token_mask": aligned.student_mask,
            **aligned.alignment.to_flat_batch(),
        }
        logits = student(aligned.student_ids)
        loss, metrics = loss_fn(
            logits, data, teacher_logits, tp_group=singles[rank], dp_group=dist.group.WORLD
        )
        optimizer.zero_grad()
        loss.backward()
        # each rank's gradient is its own chunks' part of the global loss: the sum is the global gradient
        for p in student.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        history.append({k: float(metrics[k]) for k in ("loss", "kd_loss", "ce_loss")})
    return history


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        print("xtoken_distill.py needs the tokenizers package: pip install tokenizers", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # the ranks share the machine's cores
    launched = not dist.is_initialized()
    if launched:
        if "RANK" in os.environ:
            dist.init_process_group("gloo")
        else:  # a plain `python` run: a one-rank group that needs no network
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        # rank 0 writes the projection file and every rank reads it: a directory on this machine
        # (torchrun's ranks share it; across nodes it would have to be on a shared filesystem)
        holder = [tempfile.mkdtemp(prefix="xtoken_distill_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        workdir = holder[0]
        if dist.get_rank() == 0:
            print("training two tokenizers and the teacher LM, then distilling the student ...", flush=True)
        history = distill(args, workdir)
        if dist.get_rank() == 0:
            print(f"student distilled on {dist.get_world_size()} data-parallel rank(s)")
            for step in range(0, len(history), max(1, len(history) // 10)):
                h = history[step]
                print(f"step {step:>4}  loss {h['loss']:.4f}  kd {h['kd_loss']:.4f}  ce {h['ce_loss']:.4f}")
            h = history[-1]
            print(f"final       loss {h['loss']:.4f}  kd {h['kd_loss']:.4f}  ce {h['ce_loss']:.4f}")
        dist.barrier()  # nobody reads the file any more
        if dist.get_rank() == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        return 0
    finally:
        if launched:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
