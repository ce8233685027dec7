"""The native C++ embedding kernels against the pure-torch reference, op by op and through a module.

Bounds asserted here (and stated in docs/performance.md): fp32 forward bitwise equal; fp32 SGD and
row-wise Adagrad bitwise equal; Adagrad / Adam within 1e-6 relative over several steps; fp16 / bf16
forward within one rounding of the table dtype (the native path accumulates in fp32, torch's CPU kernel
may not).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shardkit.kernels import (
    RowOptimizerArgs,
    embedding_forward,
    embedding_fused_backward,
    kernel_backend,
    native_enabled_by_env,
    native_ops,
)

NATIVE_OFF = not native_enabled_by_env()
needs_native = pytest.mark.skipif(NATIVE_OFF, reason="SHARDKIT_NATIVE=0: the native kernels are switched off")

ROWS, DIM, BAGS = 300, 24, 40
HALF_TOL = {torch.float32: 0.0, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _batch(id_dtype=torch.int64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 7, (BAGS,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, ROWS // 2, (int(lengths.sum()),), generator=gen).to(id_dtype)
    shift = torch.randint(0, ROWS // 2, (BAGS,), generator=gen)
    psw = torch.rand(ids.numel(), generator=gen) + 0.5
    scale = 1.0 / lengths.clamp(min=1).to(torch.float32)
    return ids, offsets, shift, psw, scale


def _state(kind, dtype=torch.float32, dim=DIM):
    return {
        "SGD": (),
        "ADAGRAD": (torch.zeros(ROWS, dim),),
        "ROWWISE_ADAGRAD": (torch.zeros(ROWS),),
        "ADAM": (torch.zeros(ROWS, dim), torch.zeros(ROWS, dim)),
    }[kind]


def test_native_kernels_build_on_this_machine():
    # CI has a compiler: the native path must really be in use there, not silently replaced
    if NATIVE_OFF:
        assert native_ops() is None
    else:
        assert native_ops() is not None


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("pooled", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
# the blocks of whole vectors up to 64 (AVX2) / 128 (AVX-512) columns that divide the dim: 24 and 40 one
# pass of 3 / 5 ymm on AVX2 (8-wide passes on AVX-512), 48 one pass (three of 16 on AVX-512), 96 two of 48
# (one of 96), 128 two of 64 (one of 128); 20 a run-time width (fp32 unweighted bags take the
# vector-register sums)
@pytest.mark.parametrize("dim", [DIM, 20, 40, 48, 96, 128])
def test_forward_matches_torch(dtype, id_dtype, pooled, weighted, scaled, dim):
    weight = torch.randn(ROWS, dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    ids, offsets, shift, psw, scale = _batch(id_dtype)
    args = (weight, ids, offsets, shift, psw if weighted else None, scale if scaled else None, pooled)
    with kernel_backend("torch"):
        expected = embedding_forward(*args)
    with kernel_backend("native"):
        got = embedding_forward(*args)
    assert got.dtype == dtype and got.shape == expected.shape
    if dtype == torch.float32 or not pooled:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(
            got.float(), expected.float(), rtol=HALF_TOL[dtype], atol=HALF_TOL[dtype] * 8
        )


@needs_native
@pytest.mark.parametrize("kind", ["SGD", "ADAGRAD", "ROWWISE_ADAGRAD", "ADAM"])
@pytest.mark.parametrize("pooled", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# compile-time widths (8: column blocks; 24, 48, 96: 3, 6, 12 ymm on AVX2, the last in two chunks of 6;
# 128: the sweep's widest) and run-time ones (40)
@pytest.mark.parametrize("dim", [DIM, 8, 16, 40, 48, 96, 128])
def test_fused_backward_matches_torch(kind, pooled, weighted, dtype, dim):
    ids, offsets, shift, psw, scale = _batch(seed=1)
    results = {}
    for backend in ("torch", "native"):
        weight = torch.randn(ROWS, dim, generator=torch.Generator().manual_seed(4)).to(dtype)
        state = _state(kind, dim=dim)
        psw_grads = []
        for step in range(1, 4):
            rows_out = BAGS if pooled else ids.numel()
            grad = torch.randn(rows_out, dim, generator=torch.Generator().manual_seed(10 + step))
            optimizer = RowOptimizerArgs(kind, lr=0.05, eps=1e-8, step=step, state=state)
            with kernel_backend(backend):
                psw_grads.append(
                    embedding_fused_backward(
                        weight,
                        ids,
                        offsets,
                        shift,
                        psw if weighted and pooled else None,
                        scale if pooled else None,
                        grad,
                        pooled,
                        optimizer,
                        want_psw_grad=weighted and pooled,
                    )
                )
        results[backend] = (weight, state, psw_grads)
    (w_t, s_t, g_t), (w_n, s_n, g_n) = results["torch"], results["native"]
    if kind in ("SGD", "ROWWISE_ADAGRAD") and dtype == torch.float32:
        # row-wise Adagrad: both sum a row's squares in the same order (row_sum_of_squares)
        assert torch.equal(w_n, w_t)
        for a, b in zip(s_n, s_t):
            assert torch.equal(a, b)
    elif dtype == torch.float32:
        torch.testing.assert_close(w_n, w_t, rtol=1e-6, atol=1e-6)
    else:  # both round the fp32 result to bf16: at most one bf16 step apart
        torch.testing.assert_close(w_n.float(), w_t.float(), rtol=8e-3, atol=8e-3)
    for a, b in zip(s_n, s_t):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_n, g_t):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # rows that no id reads keep their exact initial values
    ids_rows = (ids.to(torch.int64) + torch.repeat_interleave(shift, offsets.diff())).unique()
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[ids_rows] = False
    initial = torch.randn(ROWS, dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    assert torch.equal(w_n[untouched], initial[untouched])


@needs_native
@pytest.mark.parametrize("dim", [DIM, 128])  # the generic loop and the vector-register one
def test_native_out_of_range_id_raises_and_reads_nothing(dim):
    weight = torch.randn(ROWS, dim)
    ids = torch.tensor([1, 2, ROWS + 5, 3])
    offsets = torch.tensor([0, 2, 4])
    with (
        kernel_backend("native"),
        pytest.raises(IndexError, match=rf"position 2 maps to buffer row {ROWS + 5}, outside \[0, {ROWS}\)"),
    ):
        embedding_forward(weight, ids, offsets)
    with kernel_backend("native"), pytest.raises(RuntimeError, match="outside the buffer"):
        embedding_fused_backward(
            weight, ids, offsets, None, None, None, torch.ones(2, dim), True, RowOptimizerArgs("SGD", 0.1)
        )


def _run_child(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "SHARDKIT_NATIVE"}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300
    )


_CHILD = """
import torch
from shardkit.kernels import native_ops, native_failure
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
from shardkit.sparse import KeyedJaggedTensor
ebc = EmbeddingBagCollection([EmbeddingBagConfig(10, 4, name="t", feature_names=["f"])],
                             fused_optimizer=FusedOptimizerConfig("SGD", lr=0.1))
kjt = KeyedJaggedTensor(["f"], torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
for _ in range(2):
    ebc(kjt).values().sum().backward()
print("native", native_ops() is not None, "failure", native_failure())
"""


def test_without_a_compiler_the_torch_path_runs_with_one_notice(tmp_path):
    done = _run_child(_CHILD, CXX=str(tmp_path / "no-such-compiler"), SHARDKIT_CACHE=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "native False" in done.stdout
    notices = [line for line in done.stderr.splitlines() if "native CPU kernels off" in line]
    assert len(notices) == 1 and "no C++ compiler" in notices[0], done.stderr


def test_shardkit_native_0_switches_the_native_path_off(tmp_path):
    done = _run_child(_CHILD, SHARDKIT_NATIVE="0", SHARDKIT_CACHE=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "native False" in done.stdout and "SHARDKIT_NATIVE=0" in done.stderr


_WIDTHS_CHILD = """
import torch
from shardkit.kernels import native_build
# the two sources with the vector sums (and the namespace's TORCH_LIBRARY): a third of the full build
native_build._SOURCES[:] = ["embedding.cpp", "embedding_backward.cpp"]
from shardkit.kernels import RowOptimizerArgs, embedding_forward, embedding_fused_backward, kernel_backend
from shardkit.kernels import native_failure, native_ops
assert native_ops() is not None, native_failure()
gen = torch.Generator().manual_seed(0)
lengths = torch.randint(0, 5, (64,), generator=gen)
offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
ids = torch.randint(0, 90, (int(lengths.sum()),), generator=gen)
for dim in (16, 24, 32, 40, 48, 64, 96, 128):
    weight = torch.randn(100, dim, generator=gen)
    outs = {}
    for backend in ("native", "torch"):
        with kernel_backend(backend):
            outs[backend] = embedding_forward(weight, ids, offsets, None, None, None, True, batch_major=8)
    assert torch.equal(outs["native"], outs["torch"]), dim
    grad = torch.randn(8, 8 * dim, generator=gen)
    for kind in ("SGD", "ROWWISE_ADAGRAD"):
        tables = {}
        for backend in ("native", "torch"):
            table = weight.clone()
            state = (torch.zeros(100),) if kind == "ROWWISE_ADAGRAD" else ()
            with kernel_backend(backend):
                embedding_fused_backward(table, ids, offsets, None, None, None, grad, True,
                                         RowOptimizerArgs(kind, 0.1, eps=1e-8, state=state), batch_major=8)
            tables[backend] = table
        assert torch.equal(tables["native"], tables["torch"]), (dim, kind)
print("widths ok")
"""


def _has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


@needs_native
def test_the_other_vector_width_sums_as_the_torch_path(tmp_path):
    # the kernels' register sums are 16 floats wide on AVX-512 and 8 elsewhere (kVectorLanes); the
    # other tests check this machine's width. The other one, forced in a fresh build of the two sources
    # that hold the vector sums (~40 s), gives the pure-torch path's bits too (fp32 forward, SGD and
    # row-wise Adagrad backward; dims 16-128 take the vector code): gcc compiles 16-float vectors on any
    # x86-64 CPU (split where the registers are narrower) and 8-float ones on AVX-512
    lanes = "8" if _has_avx512() else "16"
    done = _run_child(_WIDTHS_CHILD, SHARDKIT_NATIVE_VECTOR_LANES=lanes, SHARDKIT_CACHE=str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "widths ok" in done.stdout


def test_a_vector_width_other_than_8_or_16_is_refused_with_a_notice(tmp_path):
    done = _run_child(_CHILD, SHARDKIT_NATIVE_VECTOR_LANES="12", SHARDKIT_CACHE=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "native False" in done.stdout and "SHARDKIT_NATIVE_VECTOR_LANES must be 8 or 16" in done.stderr


@needs_native
@pytest.mark.parametrize("kind", ["SGD", "ADAGRAD"])
def test_collection_trains_the_same_on_both_backends(kind):
    from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, PoolingType
    from shardkit.sparse import KeyedJaggedTensor

    tables = [
        EmbeddingBagConfig(50, 8, name="a", feature_names=["f0", "f1"]),
        EmbeddingBagConfig(30, 8, name="b", feature_names=["f2"], pooling=PoolingType.MEAN),
    ]
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 4, (3 * 6,), generator=gen)
    values = torch.randint(0, 30, (int(lengths.sum()),), generator=gen)
    kjt = KeyedJaggedTensor(["f0", "f1", "f2"], values, lengths=lengths)
    trained = {}
    for backend in ("torch", "native"):
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection(tables, fused_optimizer=FusedOptimizerConfig(kind, lr=0.1))
        with kernel_backend(backend):
            for _ in range(3):
                ebc(kjt).values().pow(2).sum().backward()
        trained[backend] = {name: ebc.table_weight(name).clone() for name in ("a", "b")}
    for name in ("a", "b"):
        if kind == "SGD":
            assert torch.equal(trained["native"][name], trained["torch"][name])
        else:
            torch.testing.assert_close(trained["native"][name], trained["torch"][name], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("weighted", [True, False])  # unweighted fp32: the vector-register forward
@pytest.mark.parametrize("dim", [DIM, 128])
def test_batch_major_layout_is_the_transposed_plain_layout(backend, weighted, dim):
    # 4 features x 10 samples = BAGS bags, feature-major; the batch-major output is [10, 4 * dim]
    ids, offsets, shift, psw, scale = _batch(seed=2)
    psw = psw if weighted else None
    weight = torch.randn(ROWS, dim, generator=torch.Generator().manual_seed(6))
    with kernel_backend(backend):
        plain = embedding_forward(weight, ids, offsets, shift, psw, scale, True)
        major = embedding_forward(weight, ids, offsets, shift, psw, scale, True, batch_major=10)
    assert major.shape == (10, 4 * dim)
    assert torch.equal(major, plain.view(4, 10, dim).transpose(0, 1).reshape(10, 4 * dim))

    grad_major = torch.randn(10, 4 * dim, generator=torch.Generator().manual_seed(7))
    grad_plain = grad_major.view(10, 4, dim).transpose(0, 1).reshape(BAGS, dim)
    tables = []
    for grad, batch in ((grad_plain, 0), (grad_major, 10)):
        table = weight.clone()
        with kernel_backend(backend):
            embedding_fused_backward(
                table,
                ids,
                offsets,
                shift,
                psw,
                scale,
                grad,
                True,
                RowOptimizerArgs("SGD", 0.1),
                batch_major=batch,
            )
        tables.append(table)
    assert torch.equal(tables[0], tables[1]) and not torch.equal(tables[0], weight)


@needs_native
@pytest.mark.parametrize("kind", ["SGD", "ROWWISE_ADAGRAD"])
@pytest.mark.parametrize("weighted", [False, True])
# block_bytes 0: the default (unweighted: a full sort by row, each row's run of ids summed in registers,
# update_by_row_runs; weighted: blocks of 64 KiB of sums); one row's bytes (64 at dim 16, 512 at 128): a
# full sort by row, weighted or not; 1024 / 65536: blocks of 16 / 128 rows, weighted or not
@pytest.mark.parametrize(
    "dim, block_bytes", [(16, 0), (16, 64), (16, 1024), (128, 0), (128, 512), (128, 65536)]
)
@pytest.mark.parametrize("threads", [1, 2])  # 2: per-thread digit counts merged, blocks split by thread
def test_fused_backward_sorts_exactly_across_blocks(kind, weighted, dim, block_bytes, threads):
    # the native backward groups ids by blocks of rows (a radix sort by the row's high bits), then sums
    # each row's gradients per block in position order. 20000 rows at dim 16 are 20 blocks by default,
    # 20000 one-row blocks (a full two-pass sort by row) at 64 bytes; many ids per row, so the order of
    # each row's sum matters: fp32 SGD and row-wise Adagrad must equal the pure-torch reference bitwise
    rows, bags, batch = 20_000, 600, 200  # 3 features x 200 samples, batch-major gradient
    gen = torch.Generator().manual_seed(8)
    lengths = torch.randint(0, 40, (bags,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, 300, (int(lengths.sum()),), generator=gen) ** 2 // 5  # skewed: repeats
    shift = torch.randint(0, rows - 18_000, (bags,), generator=gen)
    psw = torch.rand(ids.numel(), generator=gen) + 0.5 if weighted else None
    grad = torch.randn(batch, bags // batch * dim, generator=gen)
    initial = torch.randn(rows, dim, generator=gen)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = _both_backends(kind, ids, offsets, shift, psw, grad, initial, batch, block_bytes)
    finally:
        torch.set_num_threads(previous)
    (w_t, s_t), (w_n, s_n) = results["torch"], results["native"]
    assert not torch.equal(w_n, initial)
    assert torch.equal(w_n, w_t)
    if kind == "ROWWISE_ADAGRAD":
        assert torch.equal(s_n[0], s_t[0])


def _both_backends(kind, ids, offsets, shift, psw, grad, initial, batch, block_bytes):
    """{backend: (table, optimizer state)} after one fused backward, pure torch and native."""
    rows = initial.size(0)
    results = {}
    for backend in ("torch", "native"):
        weight = initial.clone()
        state = (torch.zeros(rows),) if kind == "ROWWISE_ADAGRAD" else ()
        optimizer = RowOptimizerArgs(kind, lr=0.05, eps=1e-8, state=state)
        if backend == "torch":
            with kernel_backend("torch"):
                embedding_fused_backward(
                    weight, ids, offsets, shift, psw, None, grad, True, optimizer, batch_major=batch
                )
        else:
            native_ops().embedding_fused_backward(
                weight,
                ids,
                offsets,
                shift,
                psw,
                None,
                grad,
                True,
                batch,
                optimizer.code,
                optimizer.lr,
                optimizer.eps,
                optimizer.beta1,
                optimizer.beta2,
                0.0,
                list(state),
                False,
                block_bytes=block_bytes,
            )
        results[backend] = (weight, state)
    return results


# --------------------------------------------------------------------------------------------------
# column slices: several lookup groups' outputs side by side (modules.fused_groups) are written and
# their gradients read in place


def _slice_of_wider(rows: int, cols: int, dtype, seed: int, left: int = 5, right: int = 3):
    """A ``[rows, cols]`` column slice (unit column stride, rows ``left + cols + right`` apart) of a
    random wider matrix, and that matrix."""
    wide = torch.randn(rows, left + cols + right, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return wide[:, left : left + cols], wide


@pytest.mark.parametrize("backend", ["torch", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pooled, batch", [(True, 0), (True, 10), (False, 0)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dim", [DIM, 16, 128])  # the generic loop and the vector-register one
def test_forward_writes_a_column_slice_in_place(backend, dtype, pooled, batch, weighted, dim):
    ids, offsets, shift, psw, scale = _batch(seed=3)
    psw = psw if weighted else None
    weight = torch.randn(ROWS, dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    with kernel_backend(backend):
        plain = embedding_forward(weight, ids, offsets, shift, psw, scale, pooled, batch_major=batch)
        out, wide = _slice_of_wider(plain.size(0), plain.size(1), dtype, seed=5)
        before = wide.clone()
        result = embedding_forward(
            weight, ids, offsets, shift, psw, scale, pooled, batch_major=batch, out=out
        )
    assert result is out and torch.equal(out, plain)
    # the columns around the slice are untouched
    assert torch.equal(wide[:, :5], before[:, :5]) and torch.equal(wide[:, -3:], before[:, -3:])


@needs_native
def test_forward_into_a_matrix_of_other_strides_or_shape():
    ids, offsets, shift, psw, scale = _batch(seed=3)
    weight = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(4))
    plain = embedding_forward(weight, ids, offsets, shift, None, None, True)
    # columns two apart: not written in place, but the result is the same
    strided = torch.zeros(BAGS, 2 * DIM)[:, ::2]
    assert torch.equal(embedding_forward(weight, ids, offsets, shift, None, None, True, out=strided), plain)
    with pytest.raises(RuntimeError, match=rf"out must be a \[{BAGS}, {DIM}\] matrix"):
        native_ops().embedding_forward_into(
            weight, ids, offsets, shift, None, None, True, 0, 16, torch.empty(BAGS, DIM + 1)
        )


@pytest.mark.parametrize("backend", ["torch", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("kind", ["SGD", "ROWWISE_ADAGRAD", "ADAM"])
@pytest.mark.parametrize("pooled, batch", [(True, 0), (True, 10), (False, 0)])
@pytest.mark.parametrize("weighted", [False, True])  # weighted: the ids keyed by position
@pytest.mark.parametrize("dim", [DIM, 8, 96, 128])  # each row's run summed in registers (96: two chunks)
def test_fused_backward_reads_a_column_slice_in_place(backend, kind, pooled, batch, weighted, dim):
    ids, offsets, shift, psw, scale = _batch(seed=8)
    psw = psw if weighted else None
    weight = torch.randn(ROWS, dim, generator=torch.Generator().manual_seed(9))
    rows, cols = (batch, BAGS // batch * dim) if batch else (BAGS if pooled else ids.numel(), dim)
    grad, _ = _slice_of_wider(rows, cols, torch.float32, seed=10)
    assert not grad.is_contiguous()
    tables, states, psw_grads = [], [], []
    for g in (grad.contiguous(), grad):
        table, state = weight.clone(), _state(kind, dim=dim)
        with kernel_backend(backend):
            psw_grads.append(
                embedding_fused_backward(
                    table,
                    ids,
                    offsets,
                    shift,
                    psw,
                    scale,
                    g,
                    pooled,
                    RowOptimizerArgs(kind, 0.1, eps=1e-8, state=state),
                    want_psw_grad=weighted and pooled,
                    batch_major=batch,
                )
            )
        tables.append(table)
        states.append(state)
    assert torch.equal(tables[0], tables[1]) and not torch.equal(tables[0], weight)
    assert all(torch.equal(a, b) for a, b in zip(*states))
    if weighted and pooled:  # the per-id weights' gradient reads the slice too
        assert torch.equal(psw_grads[0], psw_grads[1])
    else:
        assert psw_grads == [None, None]


@needs_native
def test_native_backward_names_a_gradient_of_the_wrong_shape():
    ids, offsets, shift, _, _ = _batch(seed=8)
    weight = torch.randn(ROWS, DIM)
    wrong = torch.randn(BAGS, DIM + 4)[:, : DIM - 1]  # a slice one column short
    with pytest.raises(RuntimeError, match=rf"grad must be contiguous fp32 with {BAGS} x {DIM} elements"):
        native_ops().embedding_fused_backward(
            weight, ids, offsets, shift, None, None, wrong, True, 0, 0, 0.1, 0.0, 0.0, 0.0, 0.0, [], False
        )
