"""A message-passing network on molecule-like graphs, trained with its atoms split over graph-parallel ranks.

    torchrun --nproc-per-node 2 examples/gnn_graph_parallel.py --steps 20 --check
    python examples/gnn_graph_parallel.py --steps 20        # graph parallel 1

Each batch holds several random molecules (atoms in a box, an edge between atoms closer than a cutoff).
The network predicts per-molecule energies; forces are their negative gradients w.r.t. the positions,
and it learns a simple pair potential from energy and force targets. With graph parallel
``gp``, every rank of the gp group sees the same batch but owns a contiguous block of its atoms: it
gathers all atoms' features (``gather_from_model_parallel_region_sum_grad``, whose backward adds up the
partial gradients every rank holds for every atom), computes the messages into its own atoms, and
the energies are summed over the group (``reduce_from_model_parallel_region``). Forces differentiate
through those collectives, and training differentiates the forces again (double backward).

With ``--check`` the ranks repeat the training at gp=1 (each alone) and rank 0 prints the max abs difference
of the energies and forces of every step (float64; exit code 1 above ``--tolerance``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Sequence

import torch
import torch._dynamo  # noqa: F401 - before init_process_group (torch.optim imports it later): docs/running.md
import torch.distributed as dist
from torch import nn

from shardkit import graph_parallel as gp
from shardkit.distributed.tensor_split import split_sizes

NUM_SPECIES = 4
CUTOFF = 1.6


def make_batch(molecules: int, atoms: int, seed: int) -> Dict[str, torch.Tensor]:
    """Molecules of ``atoms // 2 .. atoms`` atoms: ``pos [N, 3]`` float64, ``species [N]``,
    ``molecule [N]`` (which molecule an atom is in), edges ``src``/``dst [E]`` within ``CUTOFF``,
    and the targets ``energy [molecules]``, ``forces [N, 3]`` of the pair potential."""
    gen = torch.Generator().manual_seed(seed)
    pos, species, molecule = [], [], []
    for m in range(molecules):
        n = int(torch.randint(atoms // 2, atoms + 1, (1,), generator=gen))
        pos.append(torch.rand(n, 3, generator=gen, dtype=torch.float64) * n ** (1 / 3) * 1.2)
        species.append(torch.randint(0, NUM_SPECIES, (n,), generator=gen))
        molecule.append(torch.full((n,), m))
    pos, molecule = torch.cat(pos), torch.cat(molecule)
    close = (torch.cdist(pos, pos) < CUTOFF) & (molecule[:, None] == molecule[None, :])
    close.fill_diagonal_(False)
    src, dst = close.nonzero(as_tuple=True)
    target_pos = pos.clone().requires_grad_(True)
    energy = torch.zeros(molecules, dtype=torch.float64).index_add(
        0, molecule[src], pair_potential(target_pos, src, dst)
    )
    (grad,) = torch.autograd.grad(energy.sum(), target_pos)
    return {
        "pos": pos,
        "species": torch.cat(species),
        "molecule": molecule,
        "src": src,
        "dst": dst,
        "energy": energy.detach(),
        "forces": -grad,
    }


def pair_potential(pos: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Half of a pair energy per directed edge (each pair appears twice): a well at distance 1."""
    r = (pos[src] - pos[dst]).norm(dim=-1)
    return 0.5 * ((r - 1.0).pow(2) - 0.1)


class MessagePassing(nn.Module):
    """Species embedding, ``layers`` rounds of distance-dependent messages, per-atom energy readout."""

    def __init__(self, hidden: int, layers: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(NUM_SPECIES, hidden)
        self.messages = nn.ModuleList(
            nn.Sequential(nn.Linear(2 * hidden + 8, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
            for _ in range(layers)
        )
        self.readout = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))
        self.register_buffer("centers", torch.linspace(0.0, CUTOFF, 8))
        self.double()

    def forward(
        self, batch: Dict[str, torch.Tensor], pos: torch.Tensor, own: slice, molecules: int
    ) -> torch.Tensor:
        """Energies ``[molecules]`` of the whole batch, from this rank's atoms ``own`` and the messages
        into them; ``pos [N, 3]`` is the (differentiable) positions of all atoms."""
        mine = (batch["dst"] >= own.start) & (batch["dst"] < own.stop)
        src, dst = batch["src"][mine], batch["dst"][mine]
        pos_all = gp.gather_from_model_parallel_region_sum_grad(pos[own], dim=0)
        distance = (pos_all[src] - pos_all[dst]).norm(dim=-1, keepdim=True)
        # radial basis times a cosine cutoff: messages fade out smoothly at the cutoff
        rbf = (
            torch.exp(-4.0 * (distance - self.centers).pow(2))
            * 0.5
            * (torch.cos(torch.pi * distance / CUTOFF) + 1)
        )
        h_own = self.embed(batch["species"][own])
        for message in self.messages:
            h_all = gp.gather_from_model_parallel_region_sum_grad(h_own, dim=0)
            m = message(torch.cat([h_all[src], h_all[dst], rbf], dim=-1))
            h_own = h_own + torch.zeros_like(h_own).index_add(0, dst - own.start, m)
        atom_energy = self.readout(h_own).squeeze(-1)
        local = torch.zeros(molecules, dtype=atom_energy.dtype).index_add(
            0, batch["molecule"][own], atom_energy
        )
        return gp.reduce_from_model_parallel_region(local)


def train(args) -> List[Dict[str, torch.Tensor]]:
    """Train on this gp rank's atoms; per step, the energies and this rank's forces (before the update)."""
    rank, size = gp.get_gp_rank(), gp.get_gp_world_size()
    model = MessagePassing(args.hidden, args.layers, args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    history = []
    for step in range(args.steps):
        batch = make_batch(args.molecules, args.atoms, args.seed + step)
        sizes = split_sizes(batch["pos"].shape[0], size)
        own = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        pos = batch["pos"].clone().requires_grad_(True)
        energy = model(batch, pos, own, args.molecules)
        (grad,) = torch.autograd.grad(energy.sum(), pos, create_graph=True)
        forces = -grad[own]
        force_error = gp.reduce_from_model_parallel_region((forces - batch["forces"][own]).pow(2).sum())
        loss = (energy - batch["energy"]).pow(2).mean() + args.force_weight * force_error / pos.numel()
        optimizer.zero_grad()
        loss.backward()
        # a rank's parameter gradients cover its own atoms' messages; the full gradient is their sum
        if size > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=gp.get_gp_group())
        optimizer.step()
        history.append({"energy": energy.detach(), "forces": forces.detach(), "loss": loss.item()})
    return history


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--molecules", type=int, default=4, help="molecules per batch")
    p.add_argument("--atoms", type=int, default=24, help="most atoms per molecule")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--force-weight", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare with graph parallel 1 in this process")
    p.add_argument("--tolerance", type=float, default=1e-9)
    return p.parse_args(argv)


def run_gp(args, gp_size: int, backend: str = "gloo") -> List[Dict[str, torch.Tensor]]:
    gp.setup_gp({"gp_gpus": gp_size, "distributed_backend": backend})
    try:
        return train(args)
    finally:
        gp.cleanup_gp()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the ranks share the machine's cores
    # gp_utils needs a process group: torchrun's, or a one-rank group for a plain `python` run
    launched = not dist.is_initialized()
    if launched:
        if "RANK" in os.environ:
            dist.init_process_group("gloo")
        else:  # a one-rank group that needs no network
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        if rank == 0:
            print(
                f"{args.molecules} molecules per batch, graph parallel {world}, {args.steps} steps",
                flush=True,
            )
        history = run_gp(args, world)
        # setup_gp is collective, so every rank also runs the gp=1 reference (in a group of its own)
        if rank == 0 and args.check:
            print("training again at graph parallel 1 for --check ...", flush=True)
        reference = run_gp(args, 1) if args.check else None
        forces = [None] * world
        # rank 0 assembles every step's forces of all atoms, in atom order
        dist.gather_object([h["forces"] for h in history], forces if rank == 0 else None, dst=0)
        if rank != 0:
            return 0
        for step in range(0, args.steps, max(1, args.steps // 10)):
            print(f"step {step:>4}  loss {history[step]['loss']:.5f}")
        if reference is None:
            return 0
        e = max((h["energy"] - r["energy"]).abs().max().item() for h, r in zip(history, reference))
        f = max(
            (torch.cat([per_rank[s] for per_rank in forces]) - reference[s]["forces"]).abs().max().item()
            for s in range(args.steps)
        )
        ok = max(e, f) <= args.tolerance
        verdict = "ok" if ok else "FAILED"
        print(f"max abs difference vs graph parallel 1: energies {e:.3e}, forces {f:.3e} {verdict}")
        return 0 if ok else 1
    finally:
        if launched:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
