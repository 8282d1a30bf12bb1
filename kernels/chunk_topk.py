"""Per-chunk top-k mask selection with round-robin exploration slots, written as int16 indices.

In every chunk, the k_e exploration slots are the window ``(offset + j) mod C`` for ``j < k_e``; the
other ``k - k_e`` slots are the largest scores outside that window. Ties break towards the lower index.
Each row of the result lists its k indices in ascending order.
"""

from __future__ import annotations

import torch
from torch import Tensor


def mask_scores_ref(momentum: Tensor, residual: Tensor, beta1: float, statistic: str) -> Tensor:
    """The mask statistic of a shard.

    Args:
        momentum: First moment m of the shard (ignored for ``"gradient"``).
        residual: This rank's error-feedback residual e on the same coordinates.
        beta1: b1.
        statistic: ``"momentum"``: ``|b1*m + (1-b1)*e|``; ``"gradient"``: ``|e|``.

    Returns:
        fp32 scores, same length.
    """
    if statistic == "momentum":
        return momentum.mul(beta1).add_(residual, alpha=1.0 - beta1).abs_().float()
    if statistic == "gradient":
        return residual.abs().float()
    raise ValueError(f"mask statistic {statistic!r} has no score function; use 'momentum' or 'gradient'.")


def chunk_topk_ref(scores: Tensor, chunk_size: int, k: int, k_explore: int, explore_offset: int) -> Tensor:
    """Pure-PyTorch reference (and CPU path).

    Args:
        scores: ``[rows * chunk_size]`` float scores (NaN counts as the lowest score).
        chunk_size: C.
        k: Slots per chunk (1 <= k <= C).
        k_explore: Exploration slots per chunk (0 <= k_explore <= k).
        explore_offset: Start of this refresh's exploration window (taken mod C).

    Returns:
        ``[rows, k]`` int16 ascending chunk-local indices.
    """
    s = scores.reshape(-1, chunk_size).float()
    s = torch.nan_to_num(s, nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    if k_explore > 0:
        window = (torch.arange(k_explore, device=s.device) + explore_offset) % chunk_size
        s = s.clone()
        s[:, window] = float("inf")
    # O(C) per chunk: the k-th largest value is the threshold; all above it are taken, ties at the
    # threshold are filled in index order (a stable rule that a kernel reproduces exactly).
    thr = torch.topk(s, k, dim=1, sorted=True).values[:, -1:]
    above = s > thr
    need = k - above.sum(dim=1, keepdim=True)
    at = s == thr
    take = above | (at & (at.cumsum(dim=1) <= need))
    return take.nonzero()[:, 1].reshape(-1, k).to(torch.int16)
