"""The four tensors behind every jagged type, and their accessors.

``JaggedTensor`` and ``KeyedJaggedTensor`` both hold ``values`` (``[N, ...]``), optional ``weights``
(``[N]``), and ``lengths`` (``[rows]``) and/or ``offsets`` (``[rows + 1]``). Whichever of lengths and
offsets was not given is derived on first use and cached, without a host sync.
"""

from __future__ import annotations

from typing import Optional

import torch

from shardkit.sparse.jagged_ops import complete_cumsum, lengths_from_offsets


class JaggedFields:
    """Accessors of ``_values``, ``_weights``, ``_lengths``, ``_offsets`` (set by the subclass)."""

    _values: torch.Tensor
    _weights: Optional[torch.Tensor]
    _lengths: Optional[torch.Tensor]
    _offsets: Optional[torch.Tensor]

    def values(self) -> torch.Tensor:
        """``[N, ...]``: the ids (keyed jagged tensors) or rows (jagged tensors) of all rows, concatenated."""
        return self._values

    def weights(self) -> torch.Tensor:
        """``[N]`` per-value weights; raises ``ValueError`` if there are none."""
        if self._weights is None:
            raise ValueError(f"{type(self).__name__} has no weights; use weights_or_none()")
        return self._weights

    def weights_or_none(self) -> Optional[torch.Tensor]:
        return self._weights

    def lengths(self) -> torch.Tensor:
        """``[rows]`` number of values per row; derived from offsets and cached if needed (no host sync)."""
        if self._lengths is None:
            self._lengths = lengths_from_offsets(self._offsets)
        return self._lengths

    def lengths_or_none(self) -> Optional[torch.Tensor]:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        """``[rows + 1]`` start of each row in values; derived from lengths and cached if needed."""
        if self._offsets is None:
            self._offsets = complete_cumsum(self._lengths)
        return self._offsets

    def offsets_or_none(self) -> Optional[torch.Tensor]:
        return self._offsets

    def device(self) -> torch.device:
        return self._values.device
