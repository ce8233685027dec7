"""Serving: requests per second and p50 / p99 latency of the packaged int8 model, beside the float model
and beside torchrec's quantized EmbeddingBagCollection on the same tables, in one run.

Run from the repository root: ``python -m benchmarks.serving [--tables 8 --max-rows 20000]``. To include
torchrec, run it with a Python that has torchrec (``../shared/peers/setup.sh`` builds one with this
checkout installed): ``$PEERS/torchrec/bin/python -m benchmarks.serving``. Without torchrec the output
says so in a row of its own (no time in it).

The model is the demo's DLRM (``shardkit.models.MixedDimDLRM``, ``shardkit demo``'s tables and sizes,
untrained: the weights do not change the time). Rows, at each batch size of ``--batch-sizes``
(default 1, 32, 512 requests per forward):

- ``shardkit packaged int8``: the model with int8 tables, written by ``save_package`` and read back by
  ``load_package``, answering single-sample requests through a ``PredictModule`` (``answer``: check the
  requests, batch them into a KJT, forward, split the results): what a server runs per batch;
- ``shardkit float``: the same path with the float model (fp32 tables);
- ``shardkit QuantEBC lookup`` / ``torchrec QuantEBC lookup``: the int8 embedding lookup alone (a
  prebuilt KJT -> pooled KeyedTensor), shardkit's and torchrec 1.8's on the same tables and ids.

Columns: ``ms_p50`` / ``ms_p99`` (latency of one batch), ``requests_per_s`` (requests / total time),
``vs_float`` (the row's p50 over the float model's at that batch size) and ``vs_torchrec`` (shardkit's
lookup p50 over torchrec's). The machine is shared (2 cores, other jobs): compare rows of one run only.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from benchmarks.common import write_results


def _times(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> List[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _row(name: str, batch: int, seconds: List[float]) -> Dict[str, Any]:
    from shardkit.cli.demo_serve import percentile

    ms = [s * 1e3 for s in seconds]
    return dict(
        name=name,
        batch=batch,
        ms_p50=percentile(ms, 50),
        ms_p99=percentile(ms, 99),
        requests_per_s=batch * len(seconds) / sum(seconds),
    )


def _torchrec_ebc(configs, quantized) -> tuple:
    """torchrec's QuantEmbeddingBagCollection of the same tables with shardkit's stored int8 rows (fbgemm's
    row layout is the same: codes then fp16 scale and bias), or (None, why not)."""
    try:
        from torchrec.modules.embedding_configs import DataType as TRDataType
        from torchrec.modules.embedding_configs import EmbeddingBagConfig as TRConfig
        from torchrec.quant.embedding_modules import EmbeddingBagCollection as TRQuantEBC
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TRKJT
    except Exception as err:  # noqa: BLE001 - any import failure means: not runnable here
        return None, f"torchrec is not runnable here ({type(err).__name__}: {err})"
    tables = [
        TRConfig(
            num_embeddings=c.num_embeddings,
            embedding_dim=c.embedding_dim,
            name=c.name,
            feature_names=list(c.feature_names),
            data_type=TRDataType.INT8,
        )
        for c in configs
    ]
    weights = {}
    for c in configs:
        rows = quantized.table_weight(c.name)
        weights[c.name] = (rows[:, :-4].contiguous(), rows[:, -4:].contiguous())
    ebc = TRQuantEBC(
        tables, is_weighted=False, device=torch.device("cpu"), table_name_to_quantized_weights=weights
    )
    return (ebc, TRKJT), ""


def rows_for(args: argparse.Namespace) -> List[Dict[str, Any]]:
    import tempfile
    from pathlib import Path

    from shardkit.cli.demo_dlrm import demo_tables, make_model
    from shardkit.cli.demo_serve import demo_predict_module, requests_of
    from shardkit.datasets import SyntheticClicks
    from shardkit.inference import load_package, save_package
    from shardkit.modules import DataType
    from shardkit.quant import QuantEmbeddingBagCollection

    tables = demo_tables(args.tables, args.max_rows)
    model = make_model(tables, seed=0).eval()
    quant = make_model(tables, seed=0).eval()
    quant.ebc = QuantEmbeddingBagCollection.from_float(model.ebc, data_type=DataType.INT8)
    with tempfile.TemporaryDirectory(prefix="shardkit-serving-bench-") as tmp:
        save_package(quant, Path(tmp) / "pkg")
        packaged = load_package(Path(tmp) / "pkg")
    served = {
        "shardkit packaged int8": demo_predict_module(packaged),
        "shardkit float": demo_predict_module(model),
    }
    configs = packaged.ebc.embedding_bag_configs()
    torchrec, why_not = _torchrec_ebc(configs, packaged.ebc)
    out: List[Dict[str, Any]] = []
    for batch_size in args.batch_sizes:
        data = SyntheticClicks(tables, batch_size, model.dense_arch[0].in_features, seed=1)
        batch = data.batch(0, 0)
        requests = requests_of(batch)
        repeats = max(3, min(args.repeats, 4096 // batch_size))
        rows: Dict[str, Dict[str, Any]] = {}
        for name, module in served.items():
            rows[name] = _row(name, batch_size, _times(lambda m=module, r=requests: m.answer(r), repeats))
        kjt = batch.sparse_features
        with torch.inference_mode():
            lookup = _row(
                "shardkit QuantEBC lookup", batch_size, _times(lambda k=kjt: packaged.ebc(k), repeats)
            )
            want = packaged.ebc(kjt).values()
        rows[lookup["name"]] = lookup
        if torchrec is not None:
            ebc, trkjt_type = torchrec
            trkjt = trkjt_type(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths().to(torch.int32))
            with torch.inference_mode():
                got = ebc(trkjt).values()
                trow = _row(
                    "torchrec QuantEBC lookup", batch_size, _times(lambda e=ebc, k=trkjt: e(k), repeats)
                )
            trow["max_abs_diff_vs_shardkit"] = float((got.float() - want.float()).abs().max())
            lookup["vs_torchrec"] = lookup["ms_p50"] / trow["ms_p50"]
            rows[trow["name"]] = trow
        else:
            rows["torchrec"] = dict(name="torchrec QuantEBC lookup", batch=batch_size, note=why_not)
        float_p50 = rows["shardkit float"]["ms_p50"]
        for name in ("shardkit packaged int8", "shardkit float"):
            rows[name]["vs_float"] = rows[name]["ms_p50"] / float_p50
        out.extend(rows.values())
    return out


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--max-rows", type=int, default=20_000)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 512])
    parser.add_argument("--repeats", type=int, default=50, help="timed batches (fewer for large batches)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a shared machine)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    write_results("serving", config, rows_for(args), args.out)


if __name__ == "__main__":
    main()
