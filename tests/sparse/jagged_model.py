"""Plain-Python reference model of keyed jagged data, and hypothesis strategies that draw it.

A feature is a list of rows, a row a list of ids (and optionally a parallel list of weights). The
tensor types are checked against what these lists say, with no tensor code in between.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from hypothesis import strategies as st

from shardkit.sparse import JaggedTensor, KeyedJaggedTensor

Rows = List[List[int]]


@dataclass
class KJTModel:
    keys: List[str]
    rows: List[Rows]  # per key, per sample, the ids
    weights: Optional[List[List[List[float]]]]  # same shape as rows
    stride: int
    stride_per_key_per_rank: Optional[List[List[int]]]  # None: every key has `stride` rows

    def flat_values(self) -> List[int]:
        return [v for feature in self.rows for row in feature for v in row]

    def flat_weights(self) -> List[float]:
        return [w for feature in self.weights for row in feature for w in row]

    def flat_lengths(self) -> List[int]:
        return [len(row) for feature in self.rows for row in feature]

    def length_per_key(self) -> List[int]:
        return [sum(len(row) for row in feature) for feature in self.rows]


def row_lists(num_rows: int, max_len: int = 3):
    return st.lists(st.lists(st.integers(0, 99), max_size=max_len), min_size=num_rows, max_size=num_rows)


@st.composite
def kjt_models(
    draw,
    weighted: Optional[bool] = None,
    variable: Optional[bool] = None,
    stride: Optional[int] = None,
    max_keys: int = 4,
):
    """A KJTModel; ``stride`` fixes the batch size (and means no variable batch)."""
    num_keys = draw(st.integers(0, max_keys))
    keys = [f"f{i}" for i in range(num_keys)]
    if variable is None:
        variable = stride is None and draw(st.booleans())
    weighted = draw(st.booleans()) if weighted is None else weighted
    if variable:
        per_rank = [draw(st.lists(st.integers(0, 3), min_size=1, max_size=2)) for _ in keys]
        strides = [sum(r) for r in per_rank]
        stride = max(strides, default=0)
    else:
        per_rank = None
        stride = draw(st.integers(0, 4)) if stride is None else stride
        strides = [stride] * num_keys
    rows = [draw(row_lists(n)) for n in strides]
    weights = None
    if weighted:
        # small integers as floats compare exactly after any reordering
        weights = [[[float(draw(st.integers(-5, 5))) for _ in row] for row in feature] for feature in rows]
    return KJTModel(keys, rows, weights, stride, per_rank)


def build_kjt(
    model: KJTModel,
    use_offsets: bool = False,
    lengths_dtype: torch.dtype = torch.int64,
    values_dtype: torch.dtype = torch.int64,
) -> KeyedJaggedTensor:
    values = torch.tensor(model.flat_values(), dtype=values_dtype)
    lengths = torch.tensor(model.flat_lengths(), dtype=lengths_dtype)
    weights = torch.tensor(model.flat_weights(), dtype=torch.float) if model.weights is not None else None
    kwargs = (
        {"offsets": torch.cat([lengths.new_zeros(1), lengths.cumsum(0).to(lengths_dtype)])}
        if use_offsets
        else {}
    )
    return KeyedJaggedTensor(
        model.keys,
        values,
        weights,
        lengths=None if use_offsets else lengths,
        stride=model.stride if model.stride_per_key_per_rank is None else None,
        stride_per_key_per_rank=model.stride_per_key_per_rank,
        **kwargs,
    )


def split_rows(flat: List, lengths: List[int]) -> List[List]:
    out, start = [], 0
    for n in lengths:
        out.append(flat[start : start + n])
        start += n
    return out


def jt_rows(jt: JaggedTensor) -> Rows:
    return split_rows(jt.values().tolist(), jt.lengths().tolist())


def jt_weight_rows(jt: JaggedTensor) -> Optional[List[List[float]]]:
    weights = jt.weights_or_none()
    return None if weights is None else split_rows(weights.tolist(), jt.lengths().tolist())


def kjt_to_model(kjt: KeyedJaggedTensor) -> KJTModel:
    """Read a KeyedJaggedTensor back into lists using only its flat tensors and per-key strides."""
    lengths = kjt.lengths().tolist()
    assert len(lengths) == sum(kjt.stride_per_key())
    assert kjt.offsets().tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    value_rows = split_rows(kjt.values().tolist(), lengths)
    weights = kjt.weights_or_none()
    weight_rows = split_rows(weights.tolist(), lengths) if weights is not None else None
    rows, wrows, start = [], [] if weights is not None else None, 0
    for n in kjt.stride_per_key():
        rows.append(value_rows[start : start + n])
        if wrows is not None:
            wrows.append(weight_rows[start : start + n])
        start += n
    per_rank = kjt.stride_per_key_per_rank() if kjt.variable_stride_per_key() else None
    return KJTModel(list(kjt.keys()), rows, wrows, kjt.stride(), per_rank)
