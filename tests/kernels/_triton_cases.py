"""The Triton embedding kernels against the pure-torch reference, one case per configuration.

Used two ways: ``python -m tests.kernels._triton_cases`` with ``TRITON_INTERPRET=1`` runs every case
(or every PARTS-th: ``... cpu PART PARTS``) on CPU tensors in Triton's interpreter and prints the
outcomes as JSON (test_triton_embedding.py runs it in subprocesses, because the interpreter must be
chosen before the kernels are defined); the CUDA tests call :func:`run_case` in-process on a GPU. A
case returns its checks as ``[description, passed, detail]``; the caller asserts them.
"""

from __future__ import annotations

import itertools
import json
import sys
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ID_DTYPES = {"i32": torch.int32, "i64": torch.int64}
FORWARD_MODES = ("sum", "weighted", "mean", "sequence")
BACKWARD_MODES = ("sum", "weighted", "mean", "sequence")
OPTIMIZER_KINDS = ("SGD", "ADAGRAD", "ROWWISE_ADAGRAD", "ADAM")
# relative to max(1, |reference|): fp32 to reassociation, half types to an ulp or two of a rounding
VALUE_TOL = {"fp32": 2e-6, "fp16": 2e-3, "bf16": 1.6e-2}
STATE_TOL = 2e-6

FORWARD_CASES = [
    f"forward-{dt}-{it}-{mode}-{'shift' if shift else 'noshift'}"
    for dt, it, mode, shift in itertools.product(DTYPES, ID_DTYPES, FORWARD_MODES, (False, True))
]
BACKWARD_CASES = [
    f"backward-{opt}-{dt}-{it}-{mode}"
    for opt, dt, it, mode in itertools.product(OPTIMIZER_KINDS, DTYPES, ID_DTYPES, BACKWARD_MODES)
]
OTHER_CASES = [
    "out-of-range-id-raises",
    "unchecked-ids",
    "empty-batch",
    "dispatch-selects-triton",
    "deterministic-hot-rows",
    "measured-tiles",
    "offloaded-cache-equals-in-memory",
]
# vocab-parallel cross-entropy (shardkit.kernels.triton_ce): the statistics and gradient of each shard,
# combined across shards as the ranks would, against F.cross_entropy on the whole vocabulary
CE_CASES = ["ce-fp32", "ce-fp16", "ce-bf16", "ce-bf16-in-place", "ce-fp32-rows-longer-than-a-block"]
# the same kernels reached through shardkit.losses (kernel_backend("triton")) against its torch blocks
CE_LOSS_CASES = ["ce-loss-fp32", "ce-loss-bf16", "ce-fused-linear-fp32", "ce-fused-linear-bf16"]
CE_TOL = {"fp32": 2e-6, "fp16": 5e-4, "bf16": 4e-3}  # gradients are at most 1: an ulp or two
ALL_CASES = FORWARD_CASES + BACKWARD_CASES + OTHER_CASES + CE_CASES + CE_LOSS_CASES

OptTensor = Optional[torch.Tensor]
Batch = Tuple[torch.Tensor, torch.Tensor, OptTensor, OptTensor, OptTensor]


def make_batch(
    device: str, id_dtype: torch.dtype, mode: str, shift: bool, seed: int, rows: int = 40, bags: int = 7
) -> Batch:
    """(ids, offsets, bag_shift, per_sample_weights, bag_scale) with an empty bag, a bag of 70 ids
    (longer than a forward tile) and a hot row read 40 times (a "long" row of the fused backward)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 6, (bags,), generator=gen)
    lengths[1] = 0
    lengths[3] = 70
    offsets = torch.zeros(bags + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    n = int(offsets[-1])
    half = rows // 2
    ids = torch.randint(0, half, (n,), generator=gen)
    ids[offsets[3] : offsets[3] + 40] = 5  # hot row, more ids than triton_embedding.LONG_SEGMENT
    bag_shift = None
    if shift:
        # two "tables" in one buffer: odd bags read the upper half
        bag_shift = (torch.arange(bags) % 2) * half
    psw = torch.rand(n, generator=gen) + 0.5 if mode == "weighted" else None
    scale = None
    if mode == "mean":
        scale = torch.where(lengths > 0, 1.0 / lengths.clamp(min=1).to(torch.float32), torch.zeros(()))
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return ids.to(id_dtype).to(device), offsets.to(device), to(bag_shift), to(psw), to(scale)


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> List[Any]:
    got, want = got.detach().to(torch.float32).cpu(), want.detach().to(torch.float32).cpu()
    if got.shape != want.shape:
        return [name, False, f"shape {tuple(got.shape)} != reference {tuple(want.shape)}"]
    err = float((got - want).abs().max()) if want.numel() else 0.0
    bound = tol * max(1.0, float(want.abs().max()) if want.numel() else 0.0)
    return [name, err <= bound, f"max abs error {err:.3g}, allowed {bound:.3g}"]


def _forward_case(case: str, device: str) -> List[List[Any]]:
    from shardkit.kernels import embedding_torch, triton_embedding

    _, dt, it, mode, shift = case.split("-")
    dtype = DTYPES[dt]
    ids, offsets, bag_shift, psw, scale = make_batch(
        device, ID_DTYPES[it], mode, shift == "shift", seed=len(case)
    )
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 12, generator=gen).to(dtype).to(device)
    before = weight.clone()
    pooled = mode != "sequence"
    got = triton_embedding.embedding_forward(weight, ids, offsets, bag_shift, psw, scale, pooled)
    want = embedding_torch.embedding_forward(weight, ids, offsets, bag_shift, psw, scale, pooled)
    return [
        _close("output", got, want, VALUE_TOL[dt]),
        ["dtype", got.dtype == dtype, f"{got.dtype} vs table {dtype}"],
        ["reference is not all zeros", bool(want.abs().max() > 0), "degenerate case"],
        ["table unchanged", bool(torch.equal(weight, before)), "forward wrote to the table"],
    ]


def _optimizer(kind: str, rows: int, dim: int, device: str, seed: int):
    from shardkit.kernels import RowOptimizerArgs

    gen = torch.Generator().manual_seed(seed)
    shapes = {"SGD": [], "ADAGRAD": [(rows, dim)], "ROWWISE_ADAGRAD": [(rows,)], "ADAM": [(rows, dim)] * 2}[
        kind
    ]
    state = [torch.rand(shape, generator=gen).to(device) for shape in shapes]
    make = lambda st: RowOptimizerArgs(kind, lr=0.05, eps=1e-3, step=3, state=tuple(st))  # noqa: E731
    return make(state), make([s.clone() for s in state])


def _backward_case(case: str, device: str) -> List[List[Any]]:
    from shardkit.kernels import embedding_torch, triton_embedding

    _, kind, dt, it, mode = case.split("-")
    dtype = DTYPES[dt]
    shift = it == "i64"  # alternate: the int64 cases also shift bags into a second table
    ids, offsets, bag_shift, psw, scale = make_batch(device, ID_DTYPES[it], mode, shift, seed=len(case) + 7)
    rows, dim = 40, 12
    pooled = mode != "sequence"
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(rows, dim, generator=gen).to(dtype).to(device)
    grad = torch.randn(offsets.numel() - 1 if pooled else ids.numel(), dim, generator=gen).to(device)
    mine, ref = weight.clone(), weight.clone()
    opt_mine, opt_ref = _optimizer(kind, rows, dim, device, seed=3)
    want_psw_grad = psw is not None
    got_pg = triton_embedding.embedding_fused_backward(
        mine, ids, offsets, bag_shift, psw, scale, grad, pooled, opt_mine, want_psw_grad
    )
    want_pg = embedding_torch.embedding_fused_backward(
        ref, ids, offsets, bag_shift, psw, scale, grad, pooled, opt_ref, want_psw_grad
    )
    checks = [
        _close("updated table", mine, ref, VALUE_TOL[dt]),
        ["the step changed the table", bool((ref.float() - weight.float()).abs().max() > 0), ""],
    ]
    for index, (a, b) in enumerate(zip(opt_mine.state, opt_ref.state)):
        checks.append(_close(f"optimizer state {index}", a, b, STATE_TOL))
    if want_psw_grad:
        checks.append(_close("per-sample-weight gradient", got_pg, want_pg, STATE_TOL * 4))
    else:
        checks.append(["no per-sample-weight gradient", got_pg is None, f"got {type(got_pg)}"])
    return checks


def _other_case(case: str, device: str) -> List[List[Any]]:
    from shardkit.kernels import (
        RowOptimizerArgs,
        RowOutOfRange,
        embedding_forward,
        embedding_torch,
        kernel_backend,
        triton_embedding,
    )

    weight = torch.randn(40, 12, device=device)
    if case == "out-of-range-id-raises":
        ids = torch.tensor([1, 2, 40, 3, -1], device=device)
        offsets = torch.tensor([0, 2, 5], device=device)
        checks = []
        for pooled in (True, False):
            try:
                triton_embedding.embedding_forward(weight, ids, offsets, None, None, None, pooled)
                checks.append([f"pooled={pooled} raises RowOutOfRange", False, "no error"])
            except RowOutOfRange as error:
                checks.append([f"pooled={pooled} reports the first bad id", error.position == 2, str(error)])
        return checks
    if case == "unchecked-ids":
        # check_ids=False (a row cache's slot ids): the same results for ids in range, and no error (and
        # no read) for one outside the buffer, which adds zeros as with SHARDKIT_TRITON_CHECK_IDS=0
        ids = torch.tensor([1, 2, 39, 3, 0, 7], device=device)
        offsets = torch.tensor([0, 2, 6], device=device)
        checks = []
        for pooled in (True, False):
            args = (weight, ids, offsets, None, None, None, pooled)
            checked = triton_embedding.embedding_forward(*args)
            unchecked = triton_embedding.embedding_forward(*args, check_ids=False)
            checks.append([f"pooled={pooled} same results", torch.equal(checked, unchecked), ""])
            with kernel_backend("triton"):
                dispatched = embedding_forward(*args, check_ids=False)
            checks.append([f"pooled={pooled} dispatched the same", torch.equal(dispatched, checked), ""])
        bad = torch.tensor([1, 2, 40, 3], device=device)
        pooled_bad = triton_embedding.embedding_forward(
            weight, bad, torch.tensor([0, 2, 4], device=device), None, None, None, True, check_ids=False
        )
        want = torch.stack([weight[1] + weight[2], weight[3]])
        checks.append(["an id past the buffer adds zeros", torch.equal(pooled_bad, want), str(pooled_bad)])
        return checks
    if case == "empty-batch":
        ids = torch.zeros(0, dtype=torch.int64, device=device)
        offsets = torch.zeros(4, dtype=torch.int64, device=device)
        pooled_out = triton_embedding.embedding_forward(weight, ids, offsets, None, None, None, True)
        seq_out = triton_embedding.embedding_forward(weight, ids, offsets, None, None, None, False)
        before = weight.clone()
        pg = triton_embedding.embedding_fused_backward(
            weight,
            ids,
            offsets,
            None,
            None,
            None,
            torch.ones(3, 12, device=device),
            True,
            RowOptimizerArgs("SGD", lr=0.1),
            True,
        )
        return [
            ["pooled output is [3, 12] zeros", pooled_out.shape == (3, 12) and not pooled_out.any(), ""],
            ["sequence output is [0, 12]", seq_out.shape == (0, 12), str(tuple(seq_out.shape))],
            ["table untouched", bool(torch.equal(weight, before)), ""],
            ["psw gradient is empty", pg is not None and pg.shape == (0,), str(pg)],
        ]
    if case == "dispatch-selects-triton":
        ids, offsets, _, _, scale = make_batch(device, torch.int64, "mean", False, seed=5)
        with kernel_backend("triton"):
            got = embedding_forward(weight, ids, offsets, bag_scale=scale)
        want = embedding_torch.embedding_forward(weight, ids, offsets, None, None, scale, True)
        return [
            ["available() for this table", triton_embedding.available(weight), str(weight.device)],
            ["not available() for an int table", not triton_embedding.available(weight.to(torch.int64)), ""],
            _close("forward through the dispatch", got, want, VALUE_TOL["fp32"]),
        ]
    if case == "deterministic-hot-rows":
        gen = torch.Generator().manual_seed(9)
        ids = torch.randint(0, 4, (600,), generator=gen).to(device)  # ~150 ids per row
        offsets = torch.arange(0, 601, 3).to(device)
        grad = torch.randn(200, 12, generator=gen).to(device)
        tables = []
        for _ in range(2):
            table = weight.clone()
            triton_embedding.embedding_fused_backward(
                table, ids, offsets, None, None, None, grad, True, RowOptimizerArgs("SGD", lr=0.1), False
            )
            tables.append(table)
        ref = weight.clone()
        embedding_torch.embedding_fused_backward(
            ref, ids, offsets, None, None, None, grad, True, RowOptimizerArgs("SGD", lr=0.1), False
        )
        return [
            ["two runs bitwise equal", bool(torch.equal(tables[0], tables[1])), ""],
            _close("hot rows match the reference", tables[0], ref, 1e-5),
        ]
    if case == "measured-tiles":
        return _measured_tiles_case(device)
    raise KeyError(case)


def _measured_tiles_case(device: str) -> List[List[Any]]:
    """With tile measurement forced on (it applies to large CUDA calls only), the forward and the fused
    backward choose a tile among the candidates and still equal the reference; the user's table and
    state get exactly one step (the candidates of the backward run on a scratch table)."""
    from shardkit.kernels import embedding_torch, triton_embedding
    from shardkit.kernels import triton_tiles as tiles

    ids, offsets, bag_shift, psw, scale = make_batch(device, torch.int64, "weighted", False, seed=5)
    rows, dim = 40, 12
    weight = torch.randn(rows, dim, generator=torch.Generator().manual_seed(4)).to(device)
    grad = torch.randn(offsets.numel() - 1, dim, generator=torch.Generator().manual_seed(6)).to(device)
    applies = tiles.tuning_applies
    tiles.reset()
    tiles.tuning_applies = lambda *args: True
    try:
        got = triton_embedding.embedding_forward(weight, ids, offsets, None, psw, None, True)
        mine, ref = weight.clone(), weight.clone()
        opt_mine, opt_ref = _optimizer("ADAM", rows, dim, device, seed=8)
        got_pg = triton_embedding.embedding_fused_backward(
            mine, ids, offsets, None, psw, None, grad, True, opt_mine, True
        )
        chosen = tiles.chosen()
    finally:
        tiles.tuning_applies = applies
        tiles.reset()
    want = embedding_torch.embedding_forward(weight, ids, offsets, None, psw, None, True)
    want_pg = embedding_torch.embedding_fused_backward(
        ref, ids, offsets, None, psw, None, grad, True, opt_ref, True
    )
    kinds = {key[0]: tile for key, tile in chosen.items()}
    return [
        ["a forward and a backward tile were chosen", sorted(kinds) == ["forward", "segments"], str(chosen)],
        ["forward tile is a candidate", kinds.get("forward") in tiles.forward_candidates(dim), str(kinds)],
        ["backward tile is a candidate", kinds.get("segments") in tiles.segment_candidates(dim), str(kinds)],
        _close("forward", got, want, VALUE_TOL["fp32"]),
        _close("table after one step", mine, ref, VALUE_TOL["fp32"]),
        _close("Adam state 0", opt_mine.state[0], opt_ref.state[0], STATE_TOL),
        _close("Adam state 1", opt_mine.state[1], opt_ref.state[1], STATE_TOL),
        _close("per-sample-weight gradient", got_pg, want_pg, STATE_TOL * 4),
    ]


def _ce_case(case: str, device: str) -> List[List[Any]]:
    import torch.nn.functional as F

    from shardkit.kernels import triton_ce

    dt = case.split("-")[1]
    in_place = "in-place" in case
    gen = torch.Generator().manual_seed(11)
    if "longer" in case:
        tokens, shards = 3, [(0, 5000), (5000, 5003)]  # 5000 > the largest BLOCK_V (4096)
    else:
        tokens, shards = 12, [(0, 37), (37, 80), (80, 128)]
    vocab = shards[-1][1]
    logits = (torch.randn(tokens, vocab, generator=gen) * 4).to(DTYPES[dt]).to(device)
    target = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    target[1] = -100  # ignored
    target[2] = shards[1][0]  # a shard's first id
    stats = []
    for a, b in shards:
        stats.append(triton_ce.ce_statistics(logits[:, a:b].contiguous(), target, a))
    global_max = torch.stack([m for m, _, _ in stats]).max(0).values
    global_sum = sum(s * torch.exp(m - global_max) for m, s, _ in stats)
    target_logit = sum(t for _, _, t in stats)
    valid = target != -100
    loss = ((torch.log(global_sum) + global_max - target_logit) * valid).sum() / valid.sum()
    full = logits.float().requires_grad_()
    want_loss = F.cross_entropy(full, target, ignore_index=-100)
    want_loss.backward()
    scale = torch.full((tokens,), 1.0 / float(valid.sum()), device=device)
    grads, wrote_in_place = [], True
    for a, b in shards:
        shard = logits[:, a:b].contiguous()
        out = triton_ce.ce_gradient(
            shard, target, a, global_max, global_sum, scale, out=shard if in_place else None
        )
        wrote_in_place &= out.data_ptr() == shard.data_ptr()
        grads.append(out)
    grad = torch.cat(grads, dim=1)
    tol = CE_TOL[dt]
    return [
        _close("loss", loss.reshape(1), want_loss.detach().reshape(1), 1e-5),
        _close("gradient", grad, full.grad, tol),
        ["gradient dtype is the logits'", grad.dtype == DTYPES[dt], str(grad.dtype)],
        ["out=logits writes over the logits" if in_place else "a new tensor", wrote_in_place == in_place, ""],
        ["ignored token has a zero gradient", not bool(grad[1].float().abs().max() > 0), ""],
        [
            "max of each shard",
            all(
                bool(torch.equal(m, logits[:, a:b].float().max(1).values))
                for (m, _, _), (a, b) in zip(stats, shards)
            ),
            "",
        ],
    ]


def _count_ce_calls():
    """Wrap the Triton CE entry points with call counters; returns the counts (a dict)."""
    from shardkit.kernels import triton_ce

    calls = {"ce_statistics": 0, "ce_gradient": 0}
    for name in calls:
        original = getattr(triton_ce, name)
        if hasattr(original, "counted"):
            original = original.counted

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        counted.counted = original
        setattr(triton_ce, name, counted)
    return calls


def _fused_linear_case(case: str, device: str) -> List[List[Any]]:
    """``vocab_parallel_linear_cross_entropy`` / ``_logprobs`` with the Triton passes against the torch
    blocks: the recomputing backward (per-token losses, log-probs) and, for fp32, the gradients made in
    forward; a padded vocabulary; several row and column blocks (``chunk_size``)."""
    from shardkit.kernels import kernel_backend
    from shardkit.losses import vocab_parallel_linear_cross_entropy, vocab_parallel_linear_logprobs

    dt = DTYPES[case.split("-")[3]]
    calls = _count_ce_calls()
    gen = torch.Generator().manual_seed(13)
    H = (torch.randn(14, 8, generator=gen)).to(dt).to(device)
    W = (torch.randn(40, 8, generator=gen) * 0.7).to(dt).to(device)
    t = torch.randint(0, 37, (14,), generator=gen).to(device)
    t[3] = -100
    runs = [
        ("ce none", lambda h, w: vocab_parallel_linear_cross_entropy(h, w, t, vocab_size=37, chunk_size=4)),
        (
            "ce mean",
            lambda h, w: vocab_parallel_linear_cross_entropy(h, w, t, reduction="mean", chunk_size=4),
        ),
        ("logprobs", lambda h, w: vocab_parallel_linear_logprobs(h, w, t.clamp(min=0), chunk_size=5)),
    ]
    checks: List[List[Any]] = []
    tol = VALUE_TOL["fp32" if dt == torch.float32 else "bf16"]
    for name, fn in runs:
        results = {}
        for backend in ("torch", "triton"):
            h, w = H.clone().requires_grad_(), W.clone().requires_grad_()
            with kernel_backend(backend):
                out = fn(h, w)
                G = torch.linspace(0.5, 1.5, out.numel()).view(out.shape).to(device)
                (out * G).sum().backward()
            results[backend] = (out.detach().float(), h.grad.float(), w.grad.float())
        for what, got, want in zip(
            ("loss", "hidden grad", "weight grad"), results["triton"], results["torch"]
        ):
            checks.append(_close(f"{name}: {what}", got, want, 1e-5 if what == "loss" else tol))
    # every call ran both passes in Triton (3 losses x (forward + backward)); per block, several each
    ran = calls["ce_statistics"] >= 3 and calls["ce_gradient"] >= 3
    checks.append(["the Triton passes ran", ran, str(calls)])
    return checks


def _ce_loss_case(case: str, device: str) -> List[List[Any]]:
    """``vocab_parallel_cross_entropy`` (one process) with the Triton passes against the torch blocks:
    every reduction, ignored tokens, a padded vocabulary, the in-place backward; the kernels must run
    (counted), and an option they lack must raise when they are forced, not fall back silently."""
    from shardkit.kernels import kernel_backend
    from shardkit.losses import vocab_parallel_cross_entropy

    dt = DTYPES[case.split("-")[2]]
    calls = _count_ce_calls()
    gen = torch.Generator().manual_seed(12)
    X = (torch.randn(3, 5, 40, generator=gen) * 3).to(dt).to(device)
    t = torch.randint(0, 37, (3, 5), generator=gen).to(device)
    t[0, :2] = -100
    checks: List[List[Any]] = []
    settings = [
        {"reduction": "none"},
        {"reduction": "mean", "vocab_size": 37},  # 3 padding columns: never in the softmax, zero grad
        {"reduction": "sum", "inplace_backward": True},
    ]
    for options in settings:
        results = {}
        for backend in ("torch", "triton"):
            x = X.clone().requires_grad_()
            with kernel_backend(backend):
                # in place: the gradient overwrites a copy, so that x keeps its values for the next run
                logits = x * 1 if options.get("inplace_backward") else x
                loss = vocab_parallel_cross_entropy(logits, t, **options)
                G = torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape).to(device)
                (loss * G).sum().backward()
            results[backend] = (loss.detach().float(), x.grad.float())
        # the two paths round the bf16 gradient from different fp32 expressions: up to 2 ulps apart
        tol = VALUE_TOL["fp32" if dt == torch.float32 else "bf16"]
        checks.append(_close(f"loss {options}", results["triton"][0], results["torch"][0], 1e-5))
        checks.append(_close(f"gradient {options}", results["triton"][1], results["torch"][1], tol))
    ran = calls == {"ce_statistics": 3, "ce_gradient": 3}
    checks.append(["the Triton passes ran (one each per call)", ran, str(calls)])
    try:
        with kernel_backend("triton"):
            vocab_parallel_cross_entropy(X, t, label_smoothing=0.1)
        checks.append(["forced triton with label smoothing raises", False, "no error"])
    except RuntimeError as error:
        named = "label smoothing" in str(error)
        checks.append(["forced triton with label smoothing raises", named, str(error)])
    return checks


def _offloaded_case(device: str) -> List[List[Any]]:
    """A fused_uvm_caching lookup (a cache of 4 of 40 rows: every step evicts, the cache grows for the
    batch) run by the Triton kernels on the cache equals the in-memory lookup run by them, bitwise."""
    from shardkit.kernels import kernel_backend
    from shardkit.kernels.offload import OffloadSpec
    from shardkit.modules import EmbeddingBagConfig, FusedOptimizerConfig, OptimType
    from shardkit.modules.grouped_lookup import GroupedEmbeddingLookup, ShardSpec
    from shardkit.modules.offloaded_lookup import OffloadedEmbeddingLookup

    checks = []
    tables = [EmbeddingBagConfig(20, 12, name=f"t{i}", feature_names=[f"f{i}"]) for i in range(2)]
    for kind in ("SGD", "ROWWISE_ADAGRAD", "ADAM"):
        config = FusedOptimizerConfig(OptimType(kind), lr=0.1)
        shards = [ShardSpec(t) for t in tables]
        memory = GroupedEmbeddingLookup(shards, True, device, config)
        offloaded = OffloadedEmbeddingLookup(shards, True, device, config, OffloadSpec("caching", 0.1))
        with torch.no_grad():
            offloaded.weight.copy_(memory.weight.cpu())
        with kernel_backend("triton"):
            for step in range(4):
                ids, offsets, _, psw, _ = make_batch(
                    device, torch.int64, "weighted", False, seed=step, bags=8
                )
                ids = ids % 20
                outs = [lk(ids, offsets, [4, 4], psw) for lk in (memory, offloaded)]
                checks.append([f"{kind} step {step} forward equal", torch.equal(*outs), ""])
                for out in outs:
                    out.mul(torch.arange(12.0, device=device)).sum().backward()
        offloaded.sync_storage()  # write the cache back: weight is the backing tier
        checks.append([f"{kind} weights equal", torch.equal(offloaded.weight.cpu(), memory.weight.cpu()), ""])
        state = offloaded.optimizer.state_slices(0, 40)
        for name, value in memory.optimizer.state_slices(0, 40).items():
            checks.append([f"{kind} state {name} equal", torch.equal(state[name].cpu(), value.cpu()), ""])
    return checks


def run_case(case: str, device: str) -> List[List[Any]]:
    if case == "offloaded-cache-equals-in-memory":
        return _offloaded_case(device)
    if case.startswith("ce-loss-"):
        return _ce_loss_case(case, device)
    if case.startswith("ce-fused-linear-"):
        return _fused_linear_case(case, device)
    if case.startswith("ce-"):
        return _ce_case(case, device)
    if case.startswith("forward-"):
        return _forward_case(case, device)
    if case.startswith("backward-"):
        return _backward_case(case, device)
    return _other_case(case, device)


def run_all(device: str, part: int = 0, parts: int = 1) -> Dict[str, Any]:
    """Every case (``part`` of ``parts``: every ``parts``-th case from the ``part``-th, so that
    processes can share the cases out)."""
    from shardkit.kernels import triton_embedding

    if triton_embedding.triton_failure() is not None:
        return {"error": f"triton does not import: {triton_embedding.triton_failure()}"}
    results: Dict[str, Any] = {"interpreted": triton_embedding.INTERPRETED, "cases": {}}
    for case in ALL_CASES[part::parts]:
        try:
            results["cases"][case] = run_case(case, device)
        except Exception:
            results["cases"][case] = [["ran without an exception", False, traceback.format_exc()]]
    return results


if __name__ == "__main__":
    # python -m tests.kernels._triton_cases [DEVICE [PART PARTS]]
    part, parts = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (0, 1)
    outcome = run_all(sys.argv[1] if len(sys.argv) > 1 else "cpu", part, parts)
    print("TRITON_CASES_JSON " + json.dumps(outcome))
