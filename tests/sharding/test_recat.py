"""The recat helpers against a plain-Python model of segment reordering."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.sharding.dist_data.recat import expand_recat, feature_order, get_recat, jagged_segment_index


@st.composite
def _segments(draw):
    """Row lengths grouped in segments, and a permutation of the segments."""
    num = draw(st.integers(0, 6))
    segments = [draw(st.lists(st.integers(0, 3), max_size=4)) for _ in range(num)]
    order = draw(st.permutations(range(num)))
    return segments, list(order)


@settings(max_examples=60, deadline=None)
@given(_segments())
def test_jagged_segment_index_and_expand_recat_match_the_model(case):
    segments, order = case
    lengths = [n for seg in segments for n in seg]
    # value j of row r is labelled (r, j) so that any misplacement shows
    rows, label = [], 0
    for n in lengths:
        rows.append(list(range(label, label + n)))
        label += n
    values = torch.arange(label)
    seg_rows = [len(seg) for seg in segments]
    index = jagged_segment_index(torch.tensor(lengths, dtype=torch.int32), seg_rows, order, label)
    starts = [sum(seg_rows[:j]) for j in range(len(segments))]
    expected_rows = [r for j in order for r in range(starts[j], starts[j] + seg_rows[j])]
    assert values[index].tolist() == [v for r in expected_rows for v in rows[r]]
    assert expand_recat(order, seg_rows, torch.device("cpu")).tolist() == expected_rows


def test_feature_order_and_recat():
    assert feature_order(4, 1) == [0, 1, 2, 3]
    assert feature_order(4, 2) == [0, 2, 1, 3]
    assert feature_order(6, 3) == [0, 2, 4, 1, 3, 5]
    assert get_recat(1, 3) == [0, 1, 2]
    assert get_recat(3, 2) == [0, 3, 1, 4, 2, 5]


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("length_dtype", [torch.int32, torch.int64])
def test_permute_value_segments_native_and_torch_agree(monkeypatch, with_weights, length_dtype):
    from shardkit.sharding.dist_data import recat as recat_module

    gen = torch.Generator().manual_seed(3)
    segment_rows = [3, 0, 4, 2, 5, 1]  # an empty segment too
    lengths = torch.randint(0, 4, (sum(segment_rows),), generator=gen).to(length_dtype)
    values = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.numel(), generator=gen) if with_weights else None
    order = get_recat(2, 3)  # 2 features from 3 source ranks
    index = recat_module.jagged_segment_index(lengths, segment_rows, order, values.numel())
    got_values, got_weights = recat_module.permute_value_segments(
        lengths, values, weights, segment_rows, order
    )
    assert torch.equal(got_values, values[index])
    assert (got_weights is None) == (weights is None)
    if weights is not None:
        assert torch.equal(got_weights, weights[index])
    # the pure-torch path (no native kernels) gives the same
    monkeypatch.setattr(recat_module, "native_for", lambda device: None)
    torch_values, _ = recat_module.permute_value_segments(lengths, values, weights, segment_rows, order)
    assert torch.equal(torch_values, got_values)


def test_permute_value_segments_builds_its_index_tensors_once(monkeypatch):
    """The native path keeps the segment sizes and order as tensors between calls (a step repeats them):
    a second call with the same segments builds no tensor from host lists, and gives the same result."""
    from shardkit.kernels import native_for
    from shardkit.sharding.dist_data import recat as recat_module

    if native_for(torch.device("cpu")) is None:
        pytest.skip("no native kernels in this build")
    built = []
    real = recat_module.host_list_to_device

    def counting(values, device):
        built.append(list(values))
        return real(values, device)

    monkeypatch.setattr(recat_module, "host_list_to_device", counting)
    segment_rows, order = [2, 3, 1, 2], get_recat(2, 2)
    lengths = torch.tensor([1, 0, 2, 1, 3, 0, 1, 2])
    values = torch.arange(int(lengths.sum()))
    first, _ = recat_module.permute_value_segments(lengths, values, None, segment_rows, order)
    count = len(built)
    second, _ = recat_module.permute_value_segments(lengths, values.clone(), None, list(segment_rows), order)
    assert len(built) == count  # nothing built again
    index = recat_module.jagged_segment_index(lengths, segment_rows, order, values.numel())
    assert torch.equal(first, values[index]) and torch.equal(second, first)
