"""Table-batched lookup: the shards of several tables in one buffer, looked up by one kernel call.

A group holds shards (:class:`ShardSpec`: a table's rows ``[row_start, row_end)`` and columns
``[col_start, col_end)``) of equal width and dtype, stacked row-wise in one ``[sum rows, width]``
parameter. The unsharded modules give each table one whole-table shard; a sharded module gives each
rank the shards it owns and runs this same code. Features reach the lookup as one flat batch in the
group's feature order (for each shard, its table's features), with table ids: the group shifts every
id by its shard's place in the buffer and calls ``embedding_bag`` (or ``embedding``) once.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from shardkit import huge_pages
from shardkit.distributed.validation import host_checks_enabled
from shardkit.kernels import embedding_forward
from shardkit.modules.embedding_configs import BaseEmbeddingConfig, PoolingType
from shardkit.modules.fused_optimizers import FusedOptimizerConfig, SparseRowOptimizer
from shardkit.modules.lookup_kernels import lookup
from shardkit.sparse.validation import check_id_dtype


@dataclass(frozen=True)
class ShardSpec:
    """Rows ``[row_start, row_end)`` x columns ``[col_start, col_end)`` of the table ``config``.

    ``row_end`` / ``col_end`` of None mean the end of the table.
    """

    config: BaseEmbeddingConfig
    row_start: int = 0
    row_end: Optional[int] = None
    col_start: int = 0
    col_end: Optional[int] = None

    def __post_init__(self) -> None:
        if self.row_end is None:
            object.__setattr__(self, "row_end", self.config.num_embeddings)
        if self.col_end is None:
            object.__setattr__(self, "col_end", self.config.embedding_dim)
        if not (0 <= self.row_start < self.row_end <= self.config.num_embeddings) or not (
            0 <= self.col_start < self.col_end <= self.config.embedding_dim
        ):
            raise ValueError(
                f"shard rows [{self.row_start}, {self.row_end}) x cols [{self.col_start}, {self.col_end}) "
                f"do not fit table '{self.config.name}' of {self.config.num_embeddings} x "
                f"{self.config.embedding_dim}"
            )

    @property
    def table_name(self) -> str:
        return self.config.name

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def num_cols(self) -> int:
        return self.col_end - self.col_start


class _DeviceConstants(NamedTuple):
    shift: torch.Tensor  # [F] int64: buffer row of table id 0 of each feature's shard
    row_lo: torch.Tensor  # [F] int64: first table id the feature's shard holds
    row_hi: torch.Tensor  # [F] int64: one past the last
    is_mean: torch.Tensor  # [F] bool: feature pooled by MEAN
    feature: torch.Tensor  # [F] int64: 0 .. F-1


class KernelInputs(NamedTuple):
    """One group's lookup, checked and ready for its kernel (:meth:`GroupedEmbeddingLookup.kernel_inputs`)."""

    ids: torch.Tensor  # [N] integer table ids, feature-major
    offsets: torch.Tensor  # [B + 1] int64 bag boundaries
    bag_shift: Optional[torch.Tensor]  # [B] int64 table id -> buffer row, or None (all shifts 0)
    weights: Optional[torch.Tensor]  # [N] float per-id weights, or None
    bag_scale: Optional[torch.Tensor]  # [B] fp32 1 / bag length of MEAN bags, or None (no MEAN table)
    batch_major: int  # samples S of a sample-major [S, features * width] output, else 0
    bag_bounds: List[int]  # [F + 1] host ints: each feature's first bag


class GroupedEmbeddingLookup(nn.Module):
    """Shards of equal width and dtype in one buffer ``weight`` ``[sum of shard rows, width]``.

    Args:
        shards: the shards, stored in this order.
        pooled: True for bags (SUM / MEAN per table config), False for one row per id.
        device: where the buffer lives; ``meta`` defers allocation (see :meth:`reset_parameters`).
        fused_optimizer: if given, backward updates the touched rows in place and ``weight`` gets no
            gradient (see :mod:`shardkit.modules.fused_optimizers`).

    ``feature_names`` is the order features must arrive in: for each shard, its table's features.
    """

    def __init__(
        self,
        shards: Sequence[ShardSpec],
        pooled: bool,
        device: Optional[torch.device] = None,
        fused_optimizer: Optional[FusedOptimizerConfig] = None,
    ) -> None:
        super().__init__()
        if not shards:
            raise ValueError("a grouped lookup needs at least one shard")
        widths = {s.num_cols for s in shards}
        dtypes = {s.config.dtype for s in shards}
        if len(widths) != 1 or len(dtypes) != 1:
            raise ValueError(
                "a grouped lookup stores shards of one width and dtype, got "
                + ", ".join(f"'{s.table_name}' {s.num_cols} cols {s.config.dtype}" for s in shards)
            )
        self.shards: List[ShardSpec] = list(shards)
        self.pooled = pooled
        self.embedding_dim = widths.pop()
        self.row_offsets = [0, *accumulate(s.num_rows for s in self.shards)]
        self.feature_names = [f for s in self.shards for f in s.config.feature_names]
        self._feature_shard = [i for i, s in enumerate(self.shards) for _ in s.config.feature_names]
        self._shifts = [self.row_offsets[i] - self.shards[i].row_start for i in self._feature_shard]
        self._has_mean = pooled and any(s.config.pooling is PoolingType.MEAN for s in self.shards)
        bounds = {(s.row_start, s.row_end) for s in self.shards}
        self._uniform_bounds: Optional[Tuple[int, int]] = bounds.pop() if len(bounds) == 1 else None
        self._constants: Dict[torch.device, _DeviceConstants] = {}
        # the last three bag shifts used, newest last (see _bag_shift)
        self._last_bag_shifts: List[Tuple[Tuple[torch.device, Tuple[int, ...]], torch.Tensor]] = []
        # huge pages (advice only; SHARDKIT_HUGE_PAGES=0 switches it off): the lookups read and update
        # random rows, and with 4 KiB pages nearly every row of a large buffer is a TLB miss (a row-wise
        # Adagrad backward at 1e6 x 128 took 15-20% less CPU advised, Zen 5 VM)
        self.weight = nn.Parameter(
            huge_pages.empty(self.row_offsets[-1], self.embedding_dim, dtype=dtypes.pop(), device=device)
        )
        self.optimizer: Optional[SparseRowOptimizer] = None
        if fused_optimizer is not None:
            self.optimizer = SparseRowOptimizer(fused_optimizer, *self.weight.shape, device=device)
            # torchrec's marker of a parameter trained in backward: in_backward_optimizer_filter skips it
            self.weight._in_backward_optimizers = [fused_optimizer]
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize each shard by its table config and zero the optimizer state.

        After construction on ``meta``: ``module.to_empty(device=...)`` then ``reset_parameters()``.
        """
        for i, shard in enumerate(self.shards):
            shard.config.init_weight_(self.shard_rows(i, self.weight.data))
        if self.optimizer is not None:
            self.optimizer.reset_state()

    def sync_storage(self) -> None:
        """Make ``weight`` and the optimizer state current before reading or writing them directly (an
        offloaded lookup writes its cache back); nothing to do for an in-memory buffer."""

    def shard_rows(self, index: int, tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
        """View of shard ``index``'s rows of ``tensor`` (default the weight; also its grad, state)."""
        tensor = self.weight if tensor is None else tensor
        return tensor[self.row_offsets[index] : self.row_offsets[index + 1]]

    def _device_constants(self, device: torch.device) -> _DeviceConstants:
        # built once per device from Python lists: buffers would be garbage after to_empty()
        if device not in self._constants:
            shards = [self.shards[i] for i in self._feature_shard]

            def as_tensor(data, dtype=torch.int64):
                return torch.tensor(data, dtype=dtype, device=device)

            self._constants[device] = _DeviceConstants(
                shift=as_tensor(self._shifts),
                row_lo=as_tensor([s.row_start for s in shards]),
                row_hi=as_tensor([s.row_end for s in shards]),
                is_mean=as_tensor([s.config.pooling is PoolingType.MEAN for s in shards], torch.bool),
                feature=torch.arange(len(shards), device=device),
            )
        return self._constants[device]

    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        bags_per_feature: Sequence[int],
        weights: Optional[torch.Tensor] = None,
        sample_major: bool = False,
    ) -> torch.Tensor:
        """Look up a flat batch of the group's features.

        ids: ``[N]`` integer table ids, feature-major in ``feature_names`` order.
        offsets: ``[sum(bags_per_feature) + 1]`` bag boundaries into ids (from 0 to N).
        bags_per_feature: number of bags (batch size) of each feature, host ints.
        weights: optional ``[N]`` float per-id weights (pooled only; any float dtype).
        sample_major: pooled lookups whose features all have the same batch size S only: return
            ``[S, features * width]`` (sample s's feature f in columns ``[f * width, (f + 1) * width)``,
            the layout of a KeyedTensor) straight from the kernel, without a transpose copy.
        Returns ``[sum(bags_per_feature), width]`` pooled rows (pooled) or ``[N, width]`` rows, in the
        table dtype. Raises IndexError for an id outside its shard (unless validation is off), TypeError
        for ids of a non-integer dtype (naming the group's features).
        """
        inputs = self.kernel_inputs(ids, offsets, bags_per_feature, weights, sample_major)
        if inputs is not None:
            return self.run_kernel(inputs)
        if sample_major and bags_per_feature[0] == 0:
            # zero samples: the kernels read batch_major 0 as "feature-major [B, D]", so look up the (no)
            # bags that way and give the empty result its [0, features * width] shape; the reshape keeps
            # the autograd edge, so the backward (and a fused step) still runs
            rows = self.forward(ids, offsets, bags_per_feature, weights)
            return rows.reshape(0, len(self.feature_names) * self.embedding_dim)
        return self._meta_output(ids, bags_per_feature, bags_per_feature[0] if sample_major else 0)

    def kernel_inputs(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        bags_per_feature: Sequence[int],
        weights: Optional[torch.Tensor] = None,
        sample_major: bool = False,
    ) -> Optional[KernelInputs]:
        """:meth:`forward`'s arguments checked (its errors) and made ready for :meth:`run_kernel`; None
        where the forward takes another way: meta tensors, or ``sample_major`` with zero samples."""
        check_id_dtype(type(self).__name__, ids, self.feature_names)
        num_features = len(self.feature_names)
        if len(bags_per_feature) != num_features:
            raise ValueError(f"expected bag counts for {num_features} features, got {len(bags_per_feature)}")
        bag_bounds = [0, *accumulate(bags_per_feature)]
        if offsets.dim() != 1 or offsets.numel() != bag_bounds[-1] + 1:
            raise ValueError(f"offsets must be [{bag_bounds[-1] + 1}], got {tuple(offsets.shape)}")
        if weights is not None and weights.shape != ids.shape:
            raise ValueError(f"weights {tuple(weights.shape)} must match ids {tuple(ids.shape)}")
        if weights is not None and not self.pooled:
            raise ValueError("per-id weights apply only to pooled lookups")
        batch_major = 0
        if sample_major:
            if not self.pooled or len(set(bags_per_feature)) != 1:
                raise ValueError(
                    f"sample_major needs a pooled lookup with one batch size, got {bags_per_feature}"
                )
            batch_major = bags_per_feature[0]
            if batch_major == 0:
                return None
        if ids.is_meta or self.weight.is_meta:
            return None
        offsets = offsets.to(torch.int64)
        if host_checks_enabled() and not self._checks_ids_itself():
            self._check_ids(ids.to(torch.int64), offsets, bag_bounds)
        bag_shift = self._bag_shift(ids.device, bags_per_feature) if any(self._shifts) else None
        bag_scale = self._mean_scale(offsets, bags_per_feature) if self._has_mean else None
        return KernelInputs(ids, offsets, bag_shift, weights, bag_scale, batch_major, bag_bounds)

    def run_kernel(self, inputs: KernelInputs, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The kernel call of :meth:`kernel_inputs`' result (the forward's output; differentiable as the
        forward is). With validation off, an id outside the buffer raises the forward's IndexError.
        ``out``: the result is written into it (the output's shape and dtype, unit column stride; see
        ``kernels.embedding_forward``) and it is returned: not differentiable, for a caller that is
        itself an autograd node (``modules.fused_groups``)."""
        try:
            if out is not None:
                return self._run_kernel(*inputs[:6], out=out)
            return self._run_kernel(*inputs[:6])
        except IndexError:
            # validation was off and an id left the buffer (the kernel read nothing): name its feature
            self._check_ids(inputs.ids.to(torch.int64), inputs.offsets, inputs.bag_bounds)
            raise

    def _checks_ids_itself(self) -> bool:
        """True where :meth:`_run_kernel` checks the ids with the same error as :meth:`_check_ids`
        within a host sync it has anyway (an offloaded table's cache): the forward then skips its own."""
        return False

    def _meta_output(
        self, ids: torch.Tensor, bags_per_feature: Sequence[int], batch_major: int
    ) -> torch.Tensor:
        """The result's shape on the meta device (a model built on meta runs to learn its shapes)."""
        if batch_major:
            shape = (batch_major, len(bags_per_feature) * self.embedding_dim)
        else:
            shape = (sum(bags_per_feature) if self.pooled else ids.size(0), self.embedding_dim)
        return torch.empty(shape, dtype=self.weight.dtype, device="meta")

    def _run_kernel(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        bag_shift: Optional[torch.Tensor],
        weights: Optional[torch.Tensor],
        bag_scale: Optional[torch.Tensor],
        batch_major: int,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The one kernel call over the buffer (a quantized group overrides it: shardkit.quant); into
        ``out`` when given (:meth:`run_kernel`)."""
        if out is not None:
            return embedding_forward(
                self.weight, ids, offsets, bag_shift, weights, bag_scale, self.pooled, batch_major, out=out
            )
        return lookup(
            self.weight, ids, offsets, bag_shift, weights, bag_scale, self.pooled, self.optimizer, batch_major
        )

    def _bag_shift(self, device: torch.device, bags_per_feature: Sequence[int]) -> torch.Tensor:
        """int64 ``[sum(bags_per_feature)]``: each bag's shift from table id to buffer row (cached)."""
        key = (device, tuple(bags_per_feature))
        kept = [entry for entry in self._last_bag_shifts if entry[0] == key]
        if kept:
            bag_shift = kept[0][1]
        else:
            shift = self._device_constants(device).shift
            counts = torch.tensor(key[1], device=device)
            bag_shift = torch.repeat_interleave(shift, counts, output_size=sum(key[1]))
        # the last three used, newest last: the same tensor again for batch i+1's prefetch and its
        # forward, between which come batch i's forward and batch i+2's prefetch
        others = [entry for entry in self._last_bag_shifts if entry[0] != key]
        self._last_bag_shifts = [*others[-2:], (key, bag_shift)]
        return bag_shift

    def _per_id(
        self, per_feature: torch.Tensor, offsets: torch.Tensor, bag_bounds: List[int], num_ids: int
    ) -> torch.Tensor:
        """int64 ``[num_ids]``: ``per_feature[f]`` for each id of feature f (no host sync).

        A step function: mark each feature's first id with the change from the previous feature's
        value, then one cumsum; cheaper than repeat_interleave + gather, and empty features (whose
        marks coincide with the next feature's) need no special case.
        """
        starts = offsets.index_select(0, torch.tensor(bag_bounds[:-1], device=offsets.device))
        steps = per_feature.diff(prepend=per_feature.new_zeros(1))
        marks = torch.zeros(num_ids + 1, dtype=torch.int64, device=offsets.device).index_add_(
            0, starts, steps
        )
        return marks[:num_ids].cumsum(0)

    def _mean_scale(self, offsets: torch.Tensor, bags_per_feature: Sequence[int]) -> torch.Tensor:
        # MEAN = SUM / bag length (an empty bag stays 0); a per-bag scale in the kernel lets SUM and
        # MEAN tables share one buffer and one call, and keeps per-sample weights meaning weighted mean
        const = self._device_constants(offsets.device)
        is_mean = torch.repeat_interleave(
            const.is_mean,
            torch.tensor(list(bags_per_feature), device=offsets.device),
            output_size=offsets.numel() - 1,
        )
        lengths = offsets.diff().clamp(min=1).to(torch.float32)
        return torch.where(is_mean, lengths.reciprocal(), torch.ones_like(lengths))

    def _check_ids(self, rows: torch.Tensor, offsets: torch.Tensor, bag_bounds: List[int]) -> None:
        """IndexError naming the first id outside its shard; one host sync (SHARDKIT_VALIDATE=0 skips it)."""
        if rows.numel() == 0:
            return
        const = self._device_constants(rows.device)
        if self._uniform_bounds is not None:
            # every feature reads the same rows: one min/max pass, no per-id bounds
            low, high = self._uniform_bounds
            smallest, largest = torch.stack(torch.aminmax(rows)).tolist()
            if low <= smallest and largest < high:
                return
            bad = (rows < low) | (rows >= high)
        else:
            row_lo = self._per_id(const.row_lo, offsets, bag_bounds, rows.numel())
            row_hi = self._per_id(const.row_hi, offsets, bag_bounds, rows.numel())
            bad = (rows < row_lo) | (rows >= row_hi)
            if not bool(bad.any()):
                return
        first = int(bad.nonzero()[0, 0])
        feature = int(self._per_id(const.feature, offsets, bag_bounds, rows.numel())[first])
        shard = self.shards[self._feature_shard[feature]]
        raise IndexError(
            f"id {int(rows[first])} of feature '{self.feature_names[feature]}' is out of range for table "
            f"'{shard.table_name}' (valid ids [{shard.row_start}, {shard.row_end}))"
        )
