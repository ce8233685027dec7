"""The native lookups' prefetch distance: override, validation, the cached per-machine choice, and
bitwise-equal results at every distance (no timings here: what is measured is only checked for shape)."""

from __future__ import annotations

import json

import pytest
import torch

from shardkit.kernels import embedding, kernel_backend, native_enabled_by_env, native_ops, prefetch
from shardkit.kernels import quant_embedding as quant
from shardkit.kernels.embedding_torch import embedding_forward as torch_forward
from shardkit.kernels.quant_rows import STORAGES, quantize_rows

needs_native = pytest.mark.skipif(
    not native_enabled_by_env(), reason="SHARDKIT_NATIVE=0: the native kernels are switched off"
)
# 0: no prefetch; 1, 3: odd small ones; MAX_ROWS: beyond every id of the batch (nothing is prefetched)
DISTANCES = [0, 1, 3, 16, 64, prefetch.MAX_ROWS]


@pytest.fixture
def fresh_choice(tmp_path, monkeypatch):
    """An empty cache dir and no decision yet in this process; restores the process's decision after."""
    native_ops()  # loaded from the real cache dir first: a build into tmp_path would take minutes
    monkeypatch.setenv("SHARDKIT_CACHE", str(tmp_path))
    monkeypatch.delenv(prefetch.ENV, raising=False)
    prefetch.forget_choice()
    yield tmp_path
    prefetch.forget_choice()


def _no_measurement(*args, **kwargs):
    raise AssertionError("measured although the distance was given or cached")


def test_override_is_used_without_measuring(fresh_choice, monkeypatch):
    monkeypatch.setenv(prefetch.ENV, "24")
    monkeypatch.setattr(prefetch, "measure", _no_measurement)
    assert prefetch.prefetch_rows() == 24
    assert not prefetch.cache_file().exists()


@needs_native
def test_override_reaches_the_native_ops(fresh_choice, monkeypatch):
    monkeypatch.setenv(prefetch.ENV, "7")
    seen = []

    class Recorder:  # forwards to the real ops, keeping the distance each call got
        def __getattr__(self, name):
            op = getattr(native_ops(), name)

            def call(*args):
                seen.append((name, args[-1]))
                return op(*args)

            return call

    monkeypatch.setattr(embedding, "native_ops", Recorder)
    monkeypatch.setattr(quant, "native_ops", Recorder)
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3])
    with kernel_backend("native"):
        embedding.embedding_forward(torch.randn(8, 4), ids, offsets)
        quant.quant_embedding_forward(quantize_rows(torch.randn(8, 4), "int8"), "int8", 4, ids, offsets)
    assert seen == [("embedding_forward", 7), ("quant_embedding_forward", 7)]


@pytest.mark.parametrize("value", ["", "abc", "-1", "1.5", "0x10", str(prefetch.MAX_ROWS + 1)])
def test_invalid_override_is_a_clear_error(fresh_choice, monkeypatch, value):
    monkeypatch.setenv(prefetch.ENV, value)
    with pytest.raises(
        ValueError, match=f"{prefetch.ENV}=.*integer number of rows in \\[0, {prefetch.MAX_ROWS}\\]"
    ):
        prefetch.prefetch_rows()


@needs_native
def test_native_ops_reject_a_negative_distance():
    ids, offsets = torch.tensor([1]), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="prefetch .* must be >= 0"):
        native_ops().embedding_forward(torch.randn(4, 4), ids, offsets, None, None, None, True, 0, -1)


@needs_native
def test_choice_is_measured_once_cached_and_reused(fresh_choice, monkeypatch):
    calls = []
    real = prefetch.measure

    def small_measure():
        calls.append(1)
        return real(candidates=(8, 32), rounds=1, ids_per_call=1024)

    monkeypatch.setattr(prefetch, "measure", small_measure)
    rows = prefetch.prefetch_rows()
    assert rows in (8, 32) and calls == [1]
    record = json.loads(prefetch.cache_file().read_text())
    assert (
        record["rows"] == rows
        and record["cpu"] == prefetch.cpu_model()
        and record["torch"] == torch.__version__
    )
    assert set(record["ms"]) == {"8", "32"}
    assert prefetch.prefetch_rows() == rows and calls == [1]  # in-process
    prefetch.forget_choice()
    monkeypatch.setattr(prefetch, "measure", _no_measurement)
    assert prefetch.prefetch_rows() == rows  # from the file, another process's view
    # a different value in the file is what a later process uses (the file decides, not a constant)
    prefetch.cache_file().write_text(json.dumps({**record, "rows": 5}))
    prefetch.forget_choice()
    assert prefetch.prefetch_rows() == 5


@needs_native
def test_unreadable_cache_file_is_measured_again(fresh_choice, monkeypatch):
    prefetch.cache_file().parent.mkdir(parents=True, exist_ok=True)
    prefetch.cache_file().write_text("{not json")
    monkeypatch.setattr(prefetch, "measure", lambda: {8: 2.0, 16: 1.0, 32: 1.02})
    assert prefetch.prefetch_rows() == 16
    assert json.loads(prefetch.cache_file().read_text())["rows"] == 16


def test_choose_takes_the_smallest_within_tolerance():
    assert prefetch.choose({8: 3.0, 16: 1.02, 32: 1.0, 64: 1.01}) == 16
    assert prefetch.choose({8: 3.0, 16: 1.10, 32: 1.0, 64: 0.99}) == 32


@needs_native
@pytest.mark.parametrize("distance", DISTANCES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# block widths on AVX2: 16, 24 (one pass of 3 ymm; three passes of 8 on AVX-512), 48 of 96 (two passes),
# 64 of 128 (two passes)
@pytest.mark.parametrize("dim", [16, 24, 96, 128])
@pytest.mark.parametrize("mode", ["plain", "weighted_scaled_batch_major", "rows"])
def test_forward_is_bitwise_the_same_at_every_distance(distance, dtype, dim, mode):
    gen = torch.Generator().manual_seed(dim)
    rows, bags, batch = 200, 24, 6
    weight = torch.randn(rows, dim, generator=gen).to(dtype)
    lengths = torch.randint(0, 9, (bags,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, rows // 2, (int(lengths.sum()),), generator=gen)
    shift = torch.randint(0, rows // 2, (bags,), generator=gen)
    psw = torch.rand(ids.numel(), generator=gen) + 0.5
    scale = 1.0 / lengths.clamp(min=1).float()
    pooled, extra = mode != "rows", mode == "weighted_scaled_batch_major"
    args = (
        weight,
        ids,
        offsets,
        shift,
        psw if extra else None,
        scale if extra else None,
        pooled,
        batch if extra else 0,
    )
    got = native_ops().embedding_forward(*args, distance)
    at_default = native_ops().embedding_forward(*args, 16)
    assert torch.equal(got, at_default)  # bitwise, every dtype: a prefetch changes no value
    if dtype == torch.float32 or not pooled:  # the documented bitwise bound against pure torch
        with torch.no_grad():
            assert torch.equal(got, torch_forward(*args))


@needs_native
@pytest.mark.parametrize("distance", DISTANCES)
@pytest.mark.parametrize("storage", STORAGES)
def test_quant_lookup_is_bitwise_the_same_at_every_distance(fresh_choice, monkeypatch, distance, storage):
    monkeypatch.setenv(prefetch.ENV, str(distance))
    gen = torch.Generator().manual_seed(1)
    q = quantize_rows(torch.randn(150, 40, generator=gen), storage)
    lengths = torch.randint(0, 9, (30,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, 75, (int(lengths.sum()),), generator=gen)
    # per-bag shifts: a prefetch past the bag guesses the next bag's shift (wrong across empty bags)
    shift = torch.randint(0, 75, (30,), generator=gen)
    psw = torch.rand(ids.numel(), generator=gen)
    outs = {}
    for backend in ("torch", "native"):
        with kernel_backend(backend):
            outs[backend] = quant.quant_embedding_forward(q, storage, 40, ids, offsets, shift, psw)
    assert torch.equal(outs["native"], outs["torch"])


def test_without_native_kernels_nothing_is_measured(fresh_choice, monkeypatch):
    monkeypatch.setattr(prefetch, "native_ops", lambda: None)
    monkeypatch.setattr(prefetch, "measure", _no_measurement)
    assert prefetch.prefetch_rows() == prefetch.DEFAULT_ROWS
    assert not prefetch.cache_file().exists()


@needs_native
def test_inside_a_trace_nothing_is_measured(fresh_choice, monkeypatch):
    monkeypatch.setattr(prefetch, "measure", _no_measurement)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert prefetch.prefetch_rows() == prefetch.DEFAULT_ROWS
    prefetch.cache_file().parent.mkdir(parents=True, exist_ok=True)
    prefetch.cache_file().write_text(json.dumps({"rows": 0}))  # 0 (no prefetch) is a valid cached choice
    assert prefetch.prefetch_rows() == 0
