"""The forward's prefetch distance in the kernel comparison with fbgemm, A/B interleaved in one process.

Same setup as ``../shared/peers/vs_fbgemm_kernel.py`` (8 tables x 1e5 x 64 fp32, batch 4096, ~20 ids per
bag, one thread, fused SGD): per round fbgemm's TBE, shardkit at 16 rows (the compile-time constant before
the distance was chosen per machine) and shardkit at this machine's choice run in turn, so a burst of load
hits all three alike. Prints median ms and ratios, forward and forward + backward + SGD. Needs fbgemm
(the torchrec venv of ``../shared/peers/setup.sh``):

    PYTHONPATH=src:. $HOME/peers/torchrec/bin/python -m benchmarks.prefetch_vs_fbgemm [--rounds 15]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import warnings

import torch

from benchmarks.common import write_results
from shardkit.distributed.validation import set_validation
from shardkit.kernels import prefetch
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
from shardkit.sparse import KeyedJaggedTensor

T, R, D, B, PF = 8, 100_000, 64, 4096, 20


def _tbe():
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            EmbeddingLocation,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except ImportError as exc:
        raise SystemExit(f"needs fbgemm_gpu (the torchrec venv): {exc}") from exc
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(R, D, EmbeddingLocation.HOST, ComputeDevice.CPU)] * T,
        optimizer=EmbOptimType.EXACT_SGD,
        learning_rate=0.01,
    )


def _set_rows(rows: int) -> None:
    os.environ[prefetch.ENV] = str(rows)
    prefetch.forget_choice()
    assert prefetch.prefetch_rows() == rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=None, help="directory for prefetch_vs_fbgemm.json")
    args = parser.parse_args()
    rounds = args.rounds
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 2 * PF, (T * B,), generator=g)
    values = torch.randint(0, R, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    tbe = _tbe()
    set_validation(False)
    configs = [EmbeddingBagConfig(R, D, name=f"t{i}", feature_names=[f"f{i}"]) for i in range(T)]
    ebc = EmbeddingBagCollection(configs, fused_optimizer=FusedOptimizerConfig("SGD", lr=0.01))
    kjt = KeyedJaggedTensor([f"f{i}" for i in range(T)], values, lengths=lengths)
    os.environ.pop(prefetch.ENV, None)
    prefetch.forget_choice()
    auto = prefetch.prefetch_rows()
    print(f"per-machine choice: {auto} rows ({prefetch.cache_file()}); cpu {prefetch.cpu_model()}")

    def fwd_tbe():
        with torch.no_grad():
            tbe(values, offsets)

    def fwd_sk():
        with torch.no_grad():
            ebc(kjt)

    def fb_tbe():
        tbe(values, offsets).pow(2).mean().backward()

    def fb_sk():
        ebc(kjt).values().pow(2).mean().backward()

    cases = [("tbe", None, fwd_tbe, fb_tbe), ("sk16", 16, fwd_sk, fb_sk), (f"sk{auto}", auto, fwd_sk, fb_sk)]
    res = {(n, k): [] for n, *_ in cases for k in ("fwd", "fb")}
    for kind in ("fwd", "fb"):
        for r in range(rounds + 2):  # the first two rounds warm up
            for name, rows, f, fb in cases:
                if rows is not None:
                    _set_rows(rows)
                fn = f if kind == "fwd" else fb
                t0 = time.perf_counter()
                fn()
                if r >= 2:
                    res[(name, kind)].append((time.perf_counter() - t0) * 1e3)
    table = []
    for kind in ("fwd", "fb"):
        med = {n: statistics.median(res[(n, kind)]) for n, *_ in cases}
        line = ", ".join(f"{n} {m:.1f} ms" for n, m in med.items())
        ratios = ", ".join(f"{n}/tbe {med[n] / med['tbe']:.2f}" for n, *_ in cases[1:])
        # per-round ratio of the two shardkit settings (same round: same load)
        pr = [a / b for a, b in zip(res[(cases[2][0], kind)], res[("sk16", kind)])]
        print(
            f"{kind}: medians {line}; {ratios}; per-round sk{auto}/sk16 median {statistics.median(pr):.2f} "
            f"(min {min(pr):.2f}, max {max(pr):.2f})"
        )
        for name, *_ in cases:
            table.append(
                {"pass": kind, "case": name, "median_ms": med[name], "vs_fbgemm": med[name] / med["tbe"]}
            )
    write_results("prefetch_vs_fbgemm", {"rounds": rounds, "chosen_rows": auto}, table, args.out)


if __name__ == "__main__":
    main()
