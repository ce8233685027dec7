"""``Fp32SparseMM``: ``M.t() @ dense`` in fp32 whatever autocast is active, forward and backward."""

from __future__ import annotations

from typing import Any, Optional

import torch


def _check(sparse_M: torch.Tensor, dense: torch.Tensor) -> None:
    if not isinstance(sparse_M, torch.Tensor) or sparse_M.layout != torch.sparse_coo:
        raise TypeError(
            f"Fp32SparseMM: sparse_M must be a sparse COO tensor, got {type(sparse_M).__name__}"
            f" with layout {getattr(sparse_M, 'layout', None)}"
        )
    if sparse_M.dim() != 2 or dense.dim() != 2:
        raise ValueError(
            f"Fp32SparseMM: expected a 2-D sparse_M [V_s, V_t] and a 2-D dense [V_s, N], got shapes "
            f"{tuple(sparse_M.shape)} and {tuple(dense.shape)}"
        )
    if sparse_M.size(0) != dense.size(0):
        raise ValueError(
            f"Fp32SparseMM: sparse_M has {sparse_M.size(0)} rows but dense has {dense.size(0)} "
            f"(sparse_M {tuple(sparse_M.shape)}, dense {tuple(dense.shape)})"
        )
    if not dense.is_floating_point():
        raise TypeError(f"Fp32SparseMM: dense must be floating point, got {dense.dtype}")


class Fp32SparseMM(torch.autograd.Function):
    """``out = sparse_M.t() @ dense`` computed in fp32, ignoring any surrounding autocast.

    Args (to ``apply``):
        sparse_M: ``[V_s, V_t]`` sparse COO matrix (the frozen projection), any float dtype; it gets
            no gradient.
        dense: ``[V_s, N]`` dense, any float dtype (bf16 / fp16 / fp32 / fp64).
    Returns:
        ``[V_t, N]`` dense, fp32 (fp64 when ``dense`` is fp64).

    Saves for backward: a reference to ``sparse_M`` (no copy). Backward computes
    ``grad_dense = sparse_M @ grad_out`` in fp32 and returns it in ``dense``'s dtype.

    Why not a plain ``torch.sparse.mm``: there are no bf16 sparse-matmul kernels on CUDA, and a
    training step typically runs forward, loss *and backward* inside ``autocast(bf16)``. Disabling
    autocast around the forward call alone does not help, because ``loss.backward()`` then runs the
    sparse backward kernel inside the outer autocast. So both passes here disable autocast for the
    input's device type and cast their operands explicitly.
    """

    @staticmethod
    def forward(ctx: Any, sparse_M: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        _check(sparse_M, dense)
        work = torch.float64 if dense.dtype == torch.float64 else torch.float32
        with torch.autocast(device_type=dense.device.type, enabled=False):
            m = sparse_M if sparse_M.dtype == work else sparse_M.to(work)
            out = torch.sparse.mm(m.t(), dense.to(work))
        ctx.sparse_M = m
        ctx.dense_dtype = dense.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], torch.Tensor]:  # type: ignore[override]
        m = ctx.sparse_M
        with torch.autocast(device_type=grad_out.device.type, enabled=False):
            grad_dense = torch.sparse.mm(m, grad_out.to(m.dtype))
        # The projection matrix is frozen: no gradient for it.
        return None, grad_dense.to(ctx.dense_dtype)
