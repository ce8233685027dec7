"""lookup_output: the native forward's result in a kept buffer (distributed.comm_ops.scratch)."""

import pytest
import torch

from shardkit.distributed.comm_ops import scratch
from shardkit.kernels import embedding_forward, kernel_backend, native_ops
from shardkit.modules.lookup_kernels import lookup_output

needs_native = pytest.mark.skipif(native_ops() is None, reason="native kernels not built")

ROWS, DIM, SAMPLES, FEATURES = 500, 64, 1024, 8  # a 2 MiB sample-major output: past scratch.MIN_BYTES


def _inputs():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 4, (SAMPLES * FEATURES,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
    weight = torch.randn(ROWS, DIM, generator=gen)
    return weight, ids, offsets


@needs_native
@pytest.mark.skipif(not scratch.recv_buffers_enabled(), reason="kept buffers off (SHARDKIT_RECV_BUFFERS=0)")
def test_a_large_output_is_a_kept_buffer_handed_out_again_only_once_free():
    scratch.clear()
    weight, ids, offsets = _inputs()
    args = (weight, ids, offsets, None, None, None, True, SAMPLES)
    with kernel_backend("torch"):
        expected = embedding_forward(*args)
    first = lookup_output(*args)
    assert first.shape == (SAMPLES, FEATURES * DIM) and torch.equal(first, expected)
    held = first.data_ptr()
    second = lookup_output(*args)  # the first is still referred to: another buffer
    assert second.data_ptr() != held and torch.equal(second, expected)
    view = first[:, :DIM]  # a view holds the storage too
    del first
    third = lookup_output(*args)
    kept = {held, second.data_ptr(), third.data_ptr()}
    assert len(kept) == 3 and torch.equal(third, expected)
    del view, third
    # free now: one of the kept buffers' pages again, not new ones
    again = lookup_output(*args)
    assert again.data_ptr() in kept - {second.data_ptr()} and torch.equal(again, expected)
    scratch.clear()


@pytest.mark.parametrize("pooled, batch", [(True, 0), (False, 0)])
def test_every_layout_matches_the_forward_and_other_backends_get_a_new_tensor(pooled, batch):
    weight, ids, offsets = _inputs()
    args = (weight, ids, offsets, None, None, None, pooled, batch)
    with kernel_backend("torch"):
        expected = embedding_forward(*args)
        fresh = lookup_output(*args)
    assert torch.equal(fresh, expected)
    if native_ops() is not None:
        assert torch.equal(lookup_output(*args), expected)
