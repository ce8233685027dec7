"""``jt_is_equal`` / ``kjt_is_equal``: torchrec's structural equality of jagged tensors.

Equal when every field holds the same values: ``values`` and ``weights`` compared with
``torch.allclose`` (shapes first), lengths and offsets exactly (whichever dtype), a field present in
one and missing in the other unequal; a KeyedJaggedTensor also compares keys (same order), stride
and the per-key totals. Anything that is not the type compares unequal. Costs host syncs.
"""

from __future__ import annotations

from typing import Optional

import torch

from shardkit.sparse.jagged_tensor import JaggedTensor
from shardkit.sparse.keyed_jagged_tensor import KeyedJaggedTensor


def _close(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.allclose(a, b)


def _same_ints(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.long(), b.long())


def _same_jagged(a, b) -> bool:
    return (
        _close(a.values(), b.values())
        and _close(a.weights_or_none(), b.weights_or_none())
        and _same_ints(a.lengths(), b.lengths())
        and _same_ints(a.offsets(), b.offsets())
    )


def jt_is_equal(jt_1: JaggedTensor, jt_2: JaggedTensor) -> bool:
    if not isinstance(jt_1, JaggedTensor) or not isinstance(jt_2, JaggedTensor):
        return False
    return _same_jagged(jt_1, jt_2)


def kjt_is_equal(kjt_1: KeyedJaggedTensor, kjt_2: KeyedJaggedTensor) -> bool:
    if not isinstance(kjt_1, KeyedJaggedTensor) or not isinstance(kjt_2, KeyedJaggedTensor):
        return False
    return (
        kjt_1.keys() == kjt_2.keys()
        and kjt_1.stride() == kjt_2.stride()
        and _same_jagged(kjt_1, kjt_2)
        and kjt_1.offset_per_key() == kjt_2.offset_per_key()
    )
