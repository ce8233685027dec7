"""``shardkit env``: what this machine offers shardkit (torch, backends, devices, fast paths)."""

from __future__ import annotations

import importlib.util
import platform

import torch
import torch.distributed as dist

import shardkit


def _backend_available(name: str) -> bool:
    check = getattr(dist, f"is_{name}_available", None)
    return bool(dist.is_available() and check is not None and check())


def collect() -> dict:
    """The facts ``shardkit env`` prints, as a dict of plain values."""
    cuda = torch.cuda.is_available()
    return {
        "shardkit": shardkit.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch.distributed": dist.is_available(),
        "backends": {name: _backend_available(name) for name in ("gloo", "nccl", "mpi", "ucc")},
        "cuda": {
            "available": cuda,
            "version": torch.version.cuda,
            "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if cuda
            else [],
        },
        "cpu threads": torch.get_num_threads(),
        # optional fast paths sit behind the same API; the pure-PyTorch path is always there
        "fast paths": {
            "triton": importlib.util.find_spec("triton") is not None and cuda,
        },
    }


def _print(facts: dict, indent: int = 0) -> None:
    for key, value in facts.items():
        if isinstance(value, dict):
            print(" " * indent + f"{key}:")
            _print(value, indent + 2)
        else:
            shown = {True: "yes", False: "no"}.get(value, value) if isinstance(value, bool) else value
            print(" " * indent + f"{key}: {shown}")


def run(args) -> int:
    _print(collect())
    return 0


def add_parser(commands) -> None:
    parser = commands.add_parser("env", help="print torch version, backends, devices and fast paths")
    parser.set_defaults(run=run)
