"""Non-negative least squares and its robust refit: how ``calibration_steps`` fits the cost model's
constants to timed steps (float64 throughout)."""

from __future__ import annotations

import torch


def nnls(a: torch.Tensor, b: torch.Tensor, max_iter: int = 200) -> torch.Tensor:
    """``argmin |a x - b|`` over ``x >= 0`` (Lawson and Hanson's active-set method), float64.
    Columns are scaled to unit norm first (the features span many orders of magnitude); an all-zero
    column gets 0."""
    norms = a.norm(dim=0)
    usable = norms > 0
    scaled = torch.where(usable, a / norms.clamp(min=1e-300), torch.zeros_like(a))
    n = a.shape[1]
    x = torch.zeros(n, dtype=torch.float64)
    passive = torch.zeros(n, dtype=torch.bool)
    tol = 1e-12 * max(1.0, float(b.norm()))
    for _ in range(max_iter):
        w = scaled.T @ (b - scaled @ x)
        candidates = (~passive) & usable
        if not bool(candidates.any()) or float(w[candidates].max()) <= tol:
            break
        j = int(torch.where(candidates, w, torch.full_like(w, -float("inf"))).argmax())
        passive[j] = True
        while True:
            idx = passive.nonzero()[:, 0]
            z = torch.zeros(n, dtype=torch.float64)
            z[idx] = torch.linalg.lstsq(scaled[:, idx], b[:, None]).solution[:, 0]
            if bool((z[idx] > 0).all()):
                x = z
                break
            # move from x towards z until the first passive variable reaches 0, and release it
            bad = idx[z[idx] <= 0]
            alpha = float((x[bad] / (x[bad] - z[bad]).clamp(min=1e-300)).min())  # z <= 0 <= x there
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return torch.where(usable, x / norms.clamp(min=1e-300), torch.zeros_like(x))


# Huber's constant (in robust standard deviations): 95 % efficiency on Gaussian noise
HUBER_K = 1.345


def huber_refit(
    solve, a: torch.Tensor, known: torch.Tensor, t: torch.Tensor, x: torch.Tensor, rounds: int = 10
) -> torch.Tensor:
    """``x`` (float64, one per column of ``a``) refitted by iteratively reweighted least squares with
    Huber weights on the relative errors ``(a x + known) / t - 1`` (``min(1, k s / |error|)``, ``s``
    the errors' median absolute deviation x 1.4826; ``solve(a, weights)`` is the weighted fit): a step
    timed in a load spike (a machine shared with other work) then weighs as one error of ``k s``, not
    as its square, and cannot set a constant alone (one slow step of 16 shards made a 0.56 ms
    per-shard cost once). Errors within ``k s`` keep weight 1, so step times the model reproduces are
    fitted as before."""
    for _ in range(rounds):
        err = ((a @ x + known) / t - 1.0).abs()
        scale = 1.4826 * float(err.median())
        if scale <= 1e-9:  # the model reproduces the times (up to rounding): nothing to down-weight
            return x
        weights = (HUBER_K * scale / err.clamp(min=1e-300)).clamp(max=1.0)
        refit = solve(a, weights)
        if float((refit - x).abs().max()) <= 1e-12 * float(x.abs().max()):
            return refit
        x = refit
    return x


__all__ = ["HUBER_K", "huber_refit", "nnls"]
