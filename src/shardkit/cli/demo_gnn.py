"""``shardkit demo --model gnn``: graph-parallel message passing, checked against a single-process run.

The nodes of one graph are split over N ranks, each rank computes the messages into its own nodes,
and the energy, the forces (gradient of the energy w.r.t. positions, which differentiates through
the collectives twice) and the parameter gradients must equal the single-process result.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.regions import gather_from_region_sum_grad, reduce_from_region
from shardkit.distributed.tensor_split import split_sizes

HIDDEN = 16
NUM_SPECIES = 4


def make_graph(num_nodes: int, num_edges: int, seed: int) -> dict[str, torch.Tensor]:
    """A random molecule-like graph: positions ``[N, 3]`` float64, species ``[N]``, edges ``[E]``."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "pos": torch.randn(num_nodes, 3, generator=gen, dtype=torch.float64),
        "species": torch.randint(0, NUM_SPECIES, (num_nodes,), generator=gen),
        "src": torch.randint(0, num_nodes, (num_edges,), generator=gen),
        "dst": torch.randint(0, num_nodes, (num_edges,), generator=gen),
    }


def make_model(seed: int) -> nn.ModuleDict:
    """Species embedding, edge message MLP and per-node energy readout, float64."""
    torch.manual_seed(seed)
    model = nn.ModuleDict(
        {
            "embed": nn.Embedding(NUM_SPECIES, HIDDEN),
            "message": nn.Sequential(nn.Linear(2 * HIDDEN + 1, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, HIDDEN)),
            "readout": nn.Linear(HIDDEN, 1),
        }
    )
    return model.double()


def energy_and_loss(
    model: nn.ModuleDict,
    graph: dict[str, torch.Tensor],
    pos: torch.Tensor,
    node_range: tuple[int, int],
    group: Optional[dist.ProcessGroup],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Energy, forces of this rank's nodes ``[n_own, 3]`` and the training loss (energy + force term).

    This rank owns nodes ``[start, end)``; it gathers every node's features (the sum-grad gather,
    because each rank uses the gathered nodes for its own edges) and computes the edges into its nodes.
    Without a process group the regions are identities and this is the plain single-process model.
    """
    start, end = node_range
    own = slice(start, end)
    x_own = model["embed"](graph["species"][own])
    x_all = gather_from_region_sum_grad(x_own, group=group, dim=0)
    pos_all = gather_from_region_sum_grad(pos[own], group=group, dim=0)
    src, dst = graph["src"], graph["dst"]
    mine = (dst >= start) & (dst < end)
    src, dst = src[mine], dst[mine]
    distance = (pos_all[src] - pos_all[dst]).norm(dim=-1, keepdim=True)
    messages = model["message"](torch.cat([x_all[src], x_all[dst], distance], dim=-1))
    aggregated = torch.zeros_like(x_own).index_add(0, dst - start, messages)
    node_energy = model["readout"](torch.nn.functional.silu(x_own + aggregated))
    energy = reduce_from_region(node_energy.sum(), group=group)
    (grad_pos,) = torch.autograd.grad(energy, pos, create_graph=True)
    forces = -grad_pos[own]
    loss = energy + 0.1 * reduce_from_region(forces.pow(2).sum(), group=group)
    return energy, forces, loss


def run_rank(num_nodes: int, num_edges: int, seed: int) -> dict:
    """One rank's part: returns the energy, this rank's forces and the gp-summed parameter gradients."""
    from shardkit.graph_parallel import cleanup_gp, get_gp_group, get_gp_rank, get_gp_world_size, setup_gp

    setup_gp({"gp_gpus": dist.get_world_size(), "distributed_backend": "gloo"})
    try:
        group, rank, size = get_gp_group(), get_gp_rank(), get_gp_world_size()
        sizes = split_sizes(num_nodes, size)
        start = sum(sizes[:rank])
        graph, model = make_graph(num_nodes, num_edges, seed), make_model(seed)
        pos = graph["pos"].clone().requires_grad_(True)
        begin = time.perf_counter()
        energy, forces, loss = energy_and_loss(model, graph, pos, (start, start + sizes[rank]), group)
        loss.backward()
        # each rank's parameter gradient covers its own nodes' edges; the full gradient is their sum
        for param in model.parameters():
            dist.all_reduce(param.grad, group=group)
        seconds = time.perf_counter() - begin
        return {
            "energy": energy.item(),
            "forces": forces.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()},
            "nodes": sizes[rank],
            "edges": int(((graph["dst"] >= start) & (graph["dst"] < start + sizes[rank])).sum()),
            "seconds": seconds,
        }
    finally:
        cleanup_gp()


def reference(num_nodes: int, num_edges: int, seed: int) -> dict:
    """The same computation in this process, unsharded."""
    graph, model = make_graph(num_nodes, num_edges, seed), make_model(seed)
    pos = graph["pos"].clone().requires_grad_(True)
    energy, forces, loss = energy_and_loss(model, graph, pos, (0, num_nodes), None)
    loss.backward()
    return {
        "energy": energy.item(),
        "forces": forces.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters()},
    }


def compare(ranks: list[dict], ref: dict) -> dict[str, float]:
    """Max abs differences of energy, forces and parameter gradients (sharded vs reference)."""
    forces = torch.cat([r["forces"] for r in ranks])
    return {
        "energy": max(abs(r["energy"] - ref["energy"]) for r in ranks),
        "forces": (forces - ref["forces"]).abs().max().item(),
        "parameter gradients": max(
            (r["grads"][n] - g).abs().max().item() for r in ranks for n, g in ref["grads"].items()
        ),
    }


def run(args) -> int:
    """Run the demo as parsed by ``shardkit.cli.demo``; returns the exit code."""
    from shardkit.testing import run_world

    print(
        f"graph-parallel message passing: {args.nodes} nodes, {args.edges} edges, "
        f"{args.nproc} local CPU ranks (gloo)"
    )
    print(f"starting {args.nproc} rank processes ...", file=sys.stderr, flush=True)
    from shardkit.cli.demo import timeout_env

    ranks = run_world(run_rank, args.nproc, args.nodes, args.edges, args.seed, env=timeout_env(args))
    print(f"{'rank':>4} {'nodes':>6} {'edges':>6} {'step ms':>8}")
    for rank, result in enumerate(ranks):
        print(f"{rank:>4} {result['nodes']:>6} {result['edges']:>6} {1000 * result['seconds']:>8.1f}")
    diffs = compare(ranks, reference(args.nodes, args.edges, args.seed))
    print(f"energy {ranks[0]['energy']:.6f}; check against one process (float64):")
    tolerance = 1e-9 if args.tolerance is None else args.tolerance
    ok = True
    for name, diff in diffs.items():
        passed = diff <= tolerance
        ok &= passed
        print(f"  max abs difference of {name:<20} {diff:.3e}  {'ok' if passed else 'FAILED'}")
    print("result: sharded == unsharded" if ok else "result: MISMATCH")
    return 0 if ok else 1


def check_args(args) -> str:
    """The problem with the gnn options, or an empty string."""
    if args.nodes < args.nproc or args.edges < 0:
        return f"need --nodes >= --nproc and --edges >= 0, got --nodes {args.nodes}, --edges {args.edges}"
    return ""
