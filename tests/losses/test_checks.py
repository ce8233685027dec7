"""Bad input and disagreeing ranks: an error on every rank, before the loss's data collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed.validation import set_validation
from shardkit.losses import (
    DistributedLogprob,
    TargetOutOfRangeError,
    checks,
    parallel_cross_entropy,
    statistics,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
)
from shardkit.testing import run_world
from tests.losses.reference import randint, randn, vocab_slice

VOCAB = 13


class _Counter:
    """Counts the descriptor exchanges and the statistics all-gathers (the loss's data collective)."""

    def __init__(self):
        self.calls = {"descriptor": 0, "statistics": 0}
        self._saved = (checks.all_gather_flat, statistics.all_gather_flat)

    def __enter__(self):
        def wrap(kind, fn):
            def counted(*args, **kwargs):
                self.calls[kind] += 1
                return fn(*args, **kwargs)

            return counted

        checks.all_gather_flat = wrap("descriptor", self._saved[0])
        statistics.all_gather_flat = wrap("statistics", self._saved[1])
        return self.calls

    def __exit__(self, *exc):
        checks.all_gather_flat, statistics.all_gather_flat = self._saved


def _expect(exc_type, fn):
    with _Counter() as calls:
        with pytest.raises(exc_type) as info:
            fn()
    assert calls["statistics"] == 0, "the loss's collective ran before the error"
    return str(info.value)


def _bad_inputs_raise_everywhere():
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = vocab_slice(VOCAB, world, rank)
    X, t = randn((2, 6, VOCAB), 41), randint(VOCAB, (2, 6), 42)
    x = X[..., start:end]
    kw = dict(vocab_start_index=start, vocab_end_index=end)
    messages = {}
    bad = t.clone()
    bad[1, 2], bad[0, 5] = VOCAB + 4, -7
    messages["range"] = _expect(TargetOutOfRangeError, lambda: vocab_parallel_cross_entropy(x, bad, **kw))
    # the padded vocabulary: ids past vocab_size are out of range too
    padded = t.clone()
    padded[0, 0] = 12
    messages["padded"] = _expect(
        ValueError, lambda: vocab_parallel_cross_entropy(x, padded, vocab_size=11, **kw)
    )
    # one rank's slice does not match its shard width
    wrong = dict(vocab_start_index=start, vocab_end_index=end + (rank == 1))
    messages["width"] = _expect(ValueError, lambda: vocab_parallel_cross_entropy(x, t, **wrong))
    # default even offsets with uneven shards: the slices overlap
    messages["tiling"] = _expect(ValueError, lambda: vocab_parallel_cross_entropy(x, t))
    # shapes
    messages["shape"] = _expect(ValueError, lambda: vocab_parallel_cross_entropy(x, t[:, :5], **kw))
    # ranks disagree on the targets, the options, the number of tokens
    other = t.clone()
    other[0, 0] = (t[0, 0] + rank) % VOCAB
    messages["targets"] = _expect(ValueError, lambda: vocab_parallel_cross_entropy(x, other, **kw))
    messages["options"] = _expect(
        ValueError, lambda: vocab_parallel_cross_entropy(x, t, label_smoothing=0.1 * (rank == 0), **kw)
    )
    messages["tokens"] = _expect(
        ValueError,
        lambda: vocab_parallel_cross_entropy(x[:, : 6 - (rank == 2)], t[:, : 6 - (rank == 2)], **kw),
    )
    # fp64 logits on one rank: its buffers would have another byte size
    messages["dtype"] = _expect(
        ValueError,
        lambda: vocab_parallel_cross_entropy(x.to(torch.float64 if rank == 1 else torch.float32), t, **kw),
    )
    messages["logprob"] = _expect(
        ValueError, lambda: DistributedLogprob.apply(x, t, start, end + 1, None, False)
    )
    messages["option value"] = _expect(
        ValueError, lambda: vocab_parallel_cross_entropy(x, t, temperature=0.0, **kw)
    )
    messages["fused"] = _expect(
        ValueError,
        lambda: vocab_parallel_linear_cross_entropy(
            randn((4, 5), 43), randn((end - start, 6), 44), t[0, :4], **kw
        ),
    )
    # the spec front end: even shards only; with uneven shards its ranks find the overlap
    if VOCAB % world:
        messages["spec"] = _expect(ValueError, lambda: parallel_cross_entropy(x, t))
    # validation off: a local problem still raises before any collective at all
    set_validation(False)
    try:
        with _Counter() as calls:
            with pytest.raises(ValueError):
                vocab_parallel_cross_entropy(x, t[:, :5], **kw)
        assert calls == {"descriptor": 0, "statistics": 0}
        # and out-of-range ids are not looked for (documented): the loss is computed, no error
        out = vocab_parallel_cross_entropy(x, bad, **kw)
        assert out.shape == t.shape
    finally:
        set_validation(True)
    # the group still works after all of that
    assert dist.all_reduce(torch.ones(1)) is None
    return messages


def test_bad_inputs_raise_on_every_rank():
    results = run_world(_bad_inputs_raise_everywhere, 3, timeout=90)
    for rank, m in enumerate(results):
        assert "2 target ids are outside the vocabulary [0, 13)" in m["range"]
        assert "id 17 at position (1, 2)" in m["range"] and "id -7 at position (0, 5)" in m["range"]
        assert "[0, 11)" in m["padded"] and "id 12" in m["padded"]
        if rank == 1:
            assert "on rank 1" in m["width"] and "has 5 columns" in m["width"]
        else:
            assert "rank(s) [1] passed invalid input" in m["width"]
        assert "do not tile" in m["tiling"]
        assert "target shape (2, 5) does not match" in m["shape"]
        assert "different targets" in m["targets"]
        assert "disagree on the options" in m["options"]
        assert "disagree on the number of tokens" in m["tokens"] and "rank 2: 10" in m["tokens"]
        assert "disagree on the dtype" in m["dtype"] and "rank 1: float64" in m["dtype"]
        assert "on rank" in m["logprob"] and "columns" in m["logprob"]
        assert "temperature must be > 0" in m["option value"]
        assert "weight_shard must be [V/tp, H]" in m["fused"]
        assert "do not tile" in m["spec"]
    # verdicts reached from exchanged data are word for word the same on every rank
    for key in ("range", "padded", "tiling", "targets", "options", "tokens"):
        assert len({m[key] for m in results}) == 1
