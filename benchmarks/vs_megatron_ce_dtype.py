#!/usr/bin/env python
"""``../shared/peers/vs_megatron_ce.py`` (Megatron-core vs shardkit vocab-parallel CE) with bf16 logits.

The peer script builds fp32 shards only. This wrapper runs it unchanged except that the shard it draws
with ``torch.randn`` is cast to ``--dtype`` (the same values, rounded), in the parent and in each
spawned rank; every other argument goes to the script. Megatron's function upcasts a bf16 shard to
fp32 itself (a copy inside its forward), shardkit reads bf16 directly; the check against
``F.cross_entropy`` then runs in bf16 too, so its printed differences are those of bf16 arithmetic.

Run it with the megatron peer venv, this checkout first on the path::

    PYTHONPATH=src:. $HOME/peers/megatron/bin/python benchmarks/vs_megatron_ce_dtype.py --dtype bf16
    PYTHONPATH=src:. $HOME/peers/megatron/bin/python benchmarks/vs_megatron_ce_dtype.py --dtype fp32

(``--dtype fp32`` is the peer script itself.) ``--peer`` names another copy of the script.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ENV = "SHARDKIT_VS_MEGATRON_DTYPE"
_PEER_ENV = "SHARDKIT_VS_MEGATRON_PEER"
DEFAULT_PEER = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "peers", "vs_megatron_ce.py"
)


def _load_peer() -> types.ModuleType:
    path = os.path.abspath(os.environ.get(_PEER_ENV, DEFAULT_PEER))
    if not os.path.exists(path):
        raise SystemExit(f"vs_megatron_ce_dtype: the peer script {path} does not exist (pass --peer PATH)")
    spec = importlib.util.spec_from_file_location("vs_megatron_ce_peer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _TorchWithDtype(types.SimpleNamespace):
    """``torch`` for the peer module, whose ``randn`` draws in fp32 and rounds to the chosen dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self._dtype = dtype

    def randn(self, *args, **kwargs):
        return torch.randn(*args, **kwargs).to(self._dtype)

    def __getattr__(self, name):
        return getattr(torch, name)


def _patched_peer() -> types.ModuleType:
    peer = _load_peer()
    dtype = DTYPES[os.environ.get(_ENV, "fp32")]
    if dtype != torch.float32:
        peer.torch = _TorchWithDtype(dtype)
    # main() spawns `worker` by name: ours, which a spawned rank finds in this module and which runs
    # the peer's own worker with the patched module globals there too
    peer._original_worker, peer.worker = peer.worker, worker
    return peer


def worker(rank, args, port, q):
    return _patched_peer()._original_worker(rank, args, port, q)


def main() -> None:
    argv = sys.argv[1:]
    for flag, env in (("--dtype", _ENV), ("--peer", _PEER_ENV)):
        if flag in argv:
            i = argv.index(flag)
            if i + 1 >= len(argv):
                raise SystemExit(f"vs_megatron_ce_dtype: {flag} needs a value")
            os.environ[env] = argv[i + 1]
            del argv[i : i + 2]
    if os.environ.get(_ENV, "fp32") not in DTYPES:
        raise SystemExit(f"vs_megatron_ce_dtype: --dtype must be one of {sorted(DTYPES)}")
    sys.argv = [sys.argv[0], *argv]
    peer = _patched_peer()
    print(f"logits dtype: {os.environ.get(_ENV, 'fp32')} (the 'fp32 = ... MB' below is the peer's fp32 size)")
    peer.main()


if __name__ == "__main__":
    main()
