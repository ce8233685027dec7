"""A tiny transformer language model whose head is vocab-parallel, trained with shardkit's cross-entropy.

    torchrun --nproc-per-node 2 examples/tp_lm_head.py --steps 20 --check
    python examples/tp_lm_head.py --steps 20            # one process: the whole head on one rank

Every rank holds the same transformer trunk and a block of rows ``[start, end)`` of the head
``[V, H]`` (uneven blocks are fine). A rank computes only its logits shard ``[B, S, V/tp]``;
``vocab_parallel_cross_entropy`` finds the loss over the whole vocabulary without gathering the logits,
and ``copy_to_region`` sums the hidden state's gradient over the ranks, so the replicated trunk gets the
same (full) gradient everywhere and stays identical. The loss curve is therefore the 1-rank curve: with
``--check`` rank 0 trains an unsharded copy (``F.cross_entropy`` on full logits) on the same batches in
this process and prints the max abs difference of the two curves (exit code 1 above ``--tolerance``).
(``vocab_parallel_linear_cross_entropy`` fuses the head matmul into the loss for large vocabularies.)

The data are sequences from a random sparse Markov chain over the vocabulary, so the loss can fall well
below ``log V``; every rank draws the same batches (tensor parallelism splits the model, not the data).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

import torch
import torch._dynamo  # noqa: F401 - before init_process_group (torch.optim imports it later): docs/running.md
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.distributed.regions import copy_to_region
from shardkit.distributed.tensor_split import split_sizes
from shardkit.losses import vocab_parallel_cross_entropy


class TinyLM(nn.Module):
    """Token + position embedding, causal transformer layers, and this rank's rows of the head."""

    def __init__(self, vocab: int, hidden: int, layers: int, seq: int, head_rows: slice, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # the same full model on every rank, whatever its share of the head
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(0.02 * torch.randn(seq, hidden))
        layer = nn.TransformerEncoderLayer(
            hidden, nhead=2, dim_feedforward=2 * hidden, dropout=0.0, batch_first=True
        )
        self.trunk = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Parameter(0.02 * torch.randn(vocab, hidden)[head_rows].clone())

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [B, S]`` -> final hidden states ``[B, S, H]``."""
        seq = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, dtype=self.pos.dtype)
        x = self.embed(tokens) + self.pos[:seq]
        return self.norm(self.trunk(x, mask=mask, is_causal=True))


def markov_batches(vocab: int, batch: int, seq: int, steps: int, seed: int) -> List[torch.Tensor]:
    """``steps`` batches ``[batch, seq + 1]`` from a chain where each token has 4 likely successors."""
    gen = torch.Generator().manual_seed(seed + 1)
    successors = torch.randint(0, vocab, (vocab, 4), generator=gen)
    batches = []
    for _ in range(steps):
        tokens = [torch.randint(0, vocab, (batch,), generator=gen)]
        for _ in range(seq):
            pick = torch.randint(0, 4, (batch,), generator=gen)
            tokens.append(successors[tokens[-1], pick])
        batches.append(torch.stack(tokens, dim=1))
    return batches


def train(args, group: Optional[dist.ProcessGroup], rank: int, world: int) -> List[float]:
    """Train on this rank's head shard; the loss of every step (the same on every rank)."""
    sizes = split_sizes(args.vocab, world)
    start = sum(sizes[:rank])
    end = start + sizes[rank]
    model = TinyLM(args.vocab, args.hidden, args.layers, args.seq, slice(start, end), args.seed).to(
        DTYPES[args.dtype]
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    losses = []
    for tokens in markov_batches(args.vocab, args.batch, args.seq, args.steps, args.seed):
        h = copy_to_region(model.hidden(tokens[:, :-1]), group)
        logits_shard = F.linear(h, model.head)  # [B, S, V/tp]
        loss = vocab_parallel_cross_entropy(
            logits_shard,
            tokens[:, 1:],
            group,
            vocab_start_index=start,
            vocab_end_index=end,
            vocab_size=args.vocab,
            reduction="mean",
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_reference(args) -> List[float]:
    """The same training, unsharded, with PyTorch's own cross-entropy on the full logits."""
    model = TinyLM(args.vocab, args.hidden, args.layers, args.seq, slice(None), args.seed).to(
        DTYPES[args.dtype]
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    losses = []
    for tokens in markov_batches(args.vocab, args.batch, args.seq, args.steps, args.seed):
        logits = F.linear(model.hidden(tokens[:, :-1]), model.head)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


DTYPES = {"float32": torch.float32, "float64": torch.float64}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare with an unsharded run in this process")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max abs loss difference for --check")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the ranks share the machine's cores
    # under torchrun the launcher's variables are set; as a plain script this is one rank
    launched = "RANK" in os.environ and not dist.is_initialized()
    if launched:
        dist.init_process_group("gloo")
    try:
        distributed = dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        if rank == 0:  # before the training, so that a run says what it is doing from the start
            print(f"vocab {args.vocab} over {world} rank(s), {args.steps} steps", flush=True)
        losses = train(args, None if not distributed else dist.group.WORLD, rank, world)
        if rank != 0:
            return 0
        for step in range(0, len(losses), max(1, len(losses) // 10)):
            print(f"step {step:>4}  loss {losses[step]:.4f}")
        print(f"final loss {losses[-1]:.4f} (log V = {torch.tensor(float(args.vocab)).log():.4f})")
        if not args.check:
            return 0
        print("training the unsharded model in this process for --check ...", flush=True)
        diff = max(abs(a - b) for a, b in zip(losses, train_reference(args)))
        ok = diff <= args.tolerance
        print(f"max abs difference of the loss curve vs 1 rank: {diff:.3e} {'ok' if ok else 'FAILED'}")
        return 0 if ok else 1
    finally:
        if launched:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
