"""Chunk-level aggregation: average per-token log-probs over aligned chunks, and the chunk validity gate."""

from __future__ import annotations

import torch

from shardkit.distributed.validation import validation_enabled


def chunk_average_log_probs(
    log_probs: torch.Tensor, chunk_id: torch.Tensor, max_chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Average ``log_probs`` over the chunks given by ``chunk_id``.

    Args:
        log_probs: ``[B, T, V]`` (any float dtype; V may be a vocabulary shard or a top-k subset).
        chunk_id: ``[B, T]`` integer, values in ``[-1, max_chunks)``; ``-1`` belongs to no chunk.
        max_chunks: number of chunk buckets ``C`` (>= 0).
    Returns:
        ``(chunk_log_probs [B, C, V], chunk_sizes [B, C])``: the mean of each chunk's rows, computed
        and returned in fp32 (fp64 for fp64 input), and the number of positions in each chunk as a
        float32 tensor. An empty chunk has size 0 and an all-zero row (never NaN).

    A segment sum (``index_add``) over the ``B*T`` rows: O(B*T*V) work and one ``[B*C, V]`` output,
    unlike a one-hot ``bmm`` that costs O(B*T*C*V). Rows with ``chunk_id == -1`` are routed to one
    discarded extra bucket, so no masked copy of ``log_probs`` is made. Differentiable in
    ``log_probs``; saves nothing large for backward (the gradient of ``index_add`` is a gather).
    With validation on (``shardkit.distributed.set_validation``), out-of-range chunk ids raise
    ``ValueError`` (one host sync); with it off they are not checked.
    """
    if log_probs.dim() != 3:
        raise ValueError(
            f"chunk_average_log_probs: log_probs must be [B, T, V], got {tuple(log_probs.shape)}"
        )
    if chunk_id.shape != log_probs.shape[:2]:
        raise ValueError(
            f"chunk_average_log_probs: chunk_id shape {tuple(chunk_id.shape)} does not match log_probs "
            f"[B, T] = {tuple(log_probs.shape[:2])}"
        )
    if chunk_id.dtype.is_floating_point or chunk_id.dtype == torch.bool or chunk_id.is_complex():
        raise TypeError(f"chunk_average_log_probs: chunk_id must be an integer tensor, got {chunk_id.dtype}")
    if not log_probs.is_floating_point():
        raise TypeError(f"chunk_average_log_probs: log_probs must be floating point, got {log_probs.dtype}")
    max_chunks = int(max_chunks)
    if max_chunks < 0:
        raise ValueError(f"chunk_average_log_probs: max_chunks must be >= 0, got {max_chunks}")
    if validation_enabled() and chunk_id.numel() > 0:
        lo, hi = int(chunk_id.min()), int(chunk_id.max())
        if lo < -1 or hi >= max_chunks:
            raise ValueError(
                f"chunk_average_log_probs: chunk_id values must lie in [-1, {max_chunks}), "
                f"got min {lo} and max {hi}"
            )
    b, t, v = log_probs.shape
    work = torch.float64 if log_probs.dtype == torch.float64 else torch.float32
    cid = chunk_id.to(device=log_probs.device, dtype=torch.long)
    dump = b * max_chunks  # the extra bucket that collects the rows of no chunk
    offsets = torch.arange(b, device=cid.device).unsqueeze(1) * max_chunks
    bucket = torch.where(cid >= 0, cid + offsets, torch.full_like(cid, dump)).reshape(-1)
    sums = torch.zeros(dump + 1, v, dtype=work, device=log_probs.device)
    sums = sums.index_add(0, bucket, log_probs.reshape(b * t, v).to(work))
    sizes = torch.zeros(dump + 1, dtype=work, device=log_probs.device)
    sizes = sizes.index_add(0, bucket, torch.ones(b * t, dtype=work, device=log_probs.device))
    sizes = sizes[:dump]
    means = sums[:dump] / sizes.clamp(min=1.0).unsqueeze(1)
    return means.reshape(b, max_chunks, v), sizes.reshape(b, max_chunks).to(torch.float32)


def valid_chunk_mask(s_sizes: torch.Tensor, t_sizes: torch.Tensor, pair_valid: torch.Tensor) -> torch.Tensor:
    """Per-chunk validity: both sides non-empty and the pair valid.

    Args:
        s_sizes, t_sizes: ``[B, C]`` chunk sizes (from ``chunk_average_log_probs``), any real dtype.
        pair_valid: ``[B, C]`` bool (or 0/1 integer).
    Returns:
        ``[B, C]`` bool.
    """
    if not (s_sizes.shape == t_sizes.shape == pair_valid.shape):
        raise ValueError(
            f"valid_chunk_mask: shapes differ: s_sizes {tuple(s_sizes.shape)}, t_sizes "
            f"{tuple(t_sizes.shape)}, pair_valid {tuple(pair_valid.shape)}"
        )
    return (s_sizes > 0) & (t_sizes > 0) & pair_valid.bool()
