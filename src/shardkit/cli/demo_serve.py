"""``shardkit demo --serve``: the trained DLRM packaged, loaded in a fresh process, answering requests.

After the demo's training and exactness check, the trained model's tables are quantized to int8
(``QuantEmbeddingBagCollection.from_float``) and the model is written as a package
(``shardkit.inference.save_package``: weights and a JSON description, no code). A fresh Python process
(``multiprocessing``'s spawn: nothing of this one is inherited) loads the package with nothing but
shardkit and torch and answers a stream of single-sample requests, :data:`SERVE_BATCH` at a time, each
group batched into one KeyedJaggedTensor by the predict-module machinery (``PredictModule.answer``).
The demo prints the latency of a batch of requests (p50 / p90 / p99) and the requests per second, then
checks the answers (predicted click rates) against

- the quantized model in this process, answering the same requests the same way: the package must
  change nothing (equal within 1e-6; bitwise in practice);
- the trained fp32 model: within :data:`CTR_TOLERANCE` (int8 rows are within half a quantization step
  of the trained rows; this is how far that moves a predicted click probability).
"""

from __future__ import annotations

import copy
import math
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from shardkit.datasets import SyntheticClicks

SERVE_BATCH = 32  # requests per forward
HELD_OUT = 4  # held-out batches per training rank become the request stream
CTR_TOLERANCE = 2e-3  # max abs difference of a served click probability from the trained fp32 model's
PACKAGE_TOLERANCE = 1e-6  # served (packaged, fresh process) vs the same quantized model in this process


def requests_of(batch) -> List:
    """One :class:`~shardkit.inference.Request` per sample of a demo ``Batch``."""
    from shardkit.inference import Request

    kjt = batch.sparse_features
    size = batch.dense_features.shape[0]
    per_key = kjt.to_dict()
    sparse = {key: jt.values().split(jt.lengths().tolist()) for key, jt in per_key.items()}
    return [
        Request(sparse={key: ids[i] for key, ids in sparse.items()}, dense=batch.dense_features[i])
        for i in range(size)
    ]


def demo_predict_module(model):
    """A PredictModule serving a MixedDimDLRM: ``{"default": logits [B]}``."""
    from shardkit.inference import PredictModule, RequestBatcher
    from shardkit.inference.predict_module import FLOAT_FEATURES

    class DemoPredictModule(PredictModule):
        def __init__(self, module) -> None:
            super().__init__(module)
            configs = module.ebc.embedding_bag_configs()
            rows = {f: c.num_embeddings for c in configs for f in c.feature_names}
            self._batcher = RequestBatcher(rows, module.dense_arch[0].in_features)

        def batcher(self) -> RequestBatcher:
            return self._batcher

        def predict_forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
            logits = self.predict_module.logits(batch[FLOAT_FEATURES], self._batcher.to_kjt(batch))
            return {"default": logits.reshape(-1)}

    return DemoPredictModule(model)


def answer_all(module, requests: Sequence, batch_size: int):
    """Answer ``requests`` ``batch_size`` at a time with one thread: ``(ctr fp32 [N], [s per batch])``.

    The packaged model (fresh process) and the model before packaging (this process) both answer
    through here, so the two see the same batches and the same matmul shapes and thread count: their
    answers can be compared bitwise. A refused request is an error naming it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one serving thread: the numbers do not depend on the machine's load split
    try:
        ctr, latencies = [], []
        for first in range(0, len(requests), batch_size):
            t0 = time.perf_counter()
            answers = module.answer(requests[first : first + batch_size])
            latencies.append(time.perf_counter() - t0)
            refused = [a.error for a in answers if not a.ok]
            if refused:
                raise ValueError(f"the served model refused requests: {refused[:3]}")
            ctr.extend(float(torch.sigmoid(a.result["default"])) for a in answers)
    finally:
        torch.set_num_threads(threads)
    return torch.tensor(ctr), latencies


def serve_package(package: str, requests: Sequence, batch_size: int) -> Dict[str, object]:
    """Load the package and answer ``requests`` ``batch_size`` at a time (run in the fresh process).

    Returns ``{"ctr": fp32 [N], "latencies": [s per batch], "seconds": total, "load_seconds": ...}``."""
    from shardkit.inference import load_package

    start = time.perf_counter()
    module = demo_predict_module(load_package(package))
    load_seconds = time.perf_counter() - start
    begin = time.perf_counter()
    ctr, latencies = answer_all(module, requests, batch_size)
    return {
        "ctr": ctr,
        "latencies": latencies,
        "seconds": time.perf_counter() - begin,
        "load_seconds": load_seconds,
    }


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


def _ctr(model, batches) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat(
            [torch.sigmoid(model.logits(b.dense_features, b.sparse_features).reshape(-1)) for b in batches]
        )


def run(model, tables: Sequence, args) -> bool:
    """Package the trained ``model``, serve it from a fresh process, print and check; True if both
    checks pass."""
    from shardkit.inference import save_package
    from shardkit.modules import DataType
    from shardkit.quant import QuantEmbeddingBagCollection

    data = SyntheticClicks(tables, args.batch_size, model.dense_arch[0].in_features, args.seed)
    batches = [data.batch(args.steps + k, r) for r in range(args.nproc) for k in range(HELD_OUT)]
    requests = [req for b in batches for req in requests_of(b)]
    served = copy.deepcopy(model).eval()
    served.ebc = QuantEmbeddingBagCollection.from_float(model.ebc, data_type=DataType.INT8)
    with tempfile.TemporaryDirectory(prefix="shardkit-serve-") as tmp:
        package = save_package(served, Path(tmp) / "dlrm_int8")
        size = sum(f.stat().st_size for f in Path(package).iterdir())
        print(
            f"serving: the trained model with int8 tables packaged ({size / (1 << 20):.2f} MiB), "
            f"loaded in a fresh process, {len(requests)} requests answered {SERVE_BATCH} per batch:",
            flush=True,
        )
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            result = pool.apply(serve_package, (str(package), requests, SERVE_BATCH))
    lat_ms = [s * 1e3 for s in result["latencies"]]
    print(
        f"  package loaded in {result['load_seconds']:.2f} s; {len(requests) / result['seconds']:,.0f} "
        f"requests/s; latency of a batch p50 {percentile(lat_ms, 50):.2f} ms, p90 "
        f"{percentile(lat_ms, 90):.2f} ms, p99 {percentile(lat_ms, 99):.2f} ms (one thread, a shared CPU)"
    )
    fp32 = _ctr(model.eval(), batches)
    local, _ = answer_all(demo_predict_module(served), requests, SERVE_BATCH)  # same path, unpackaged
    vs_fp32 = float((result["ctr"] - fp32).abs().max())
    vs_local = float((result["ctr"] - local).abs().max())
    ok_fp32, ok_local = vs_fp32 <= CTR_TOLERANCE, vs_local <= PACKAGE_TOLERANCE
    print(
        f"  answers vs the trained fp32 model: predicted CTR max abs difference {vs_fp32:.2e} "
        f"(tolerance {CTR_TOLERANCE:g}) {'ok' if ok_fp32 else 'FAILED'}"
    )
    print(
        f"  answers vs the int8 model before packaging: {vs_local:.1e} (tolerance {PACKAGE_TOLERANCE:g}) "
        f"{'ok' if ok_local else 'FAILED'}"
    )
    return ok_fp32 and ok_local
