"""Decoupled weight decay on the whole replica, then the owners' new values scattered at the mask."""

from __future__ import annotations

from torch import Tensor

from ._positions import mask_positions


def scatter_decay_ref(params: Tensor, values: Tensor, mask: Tensor, chunk_size: int, decay: float) -> None:
    """Pure-PyTorch reference (and CPU path): ``params *= decay; params[mask] = values``.

    Args:
        params: ``[rows * chunk_size]`` flat parameter replica, updated in place.
        values: ``[rows * k]`` new parameter values at the mask, in mask order.
        mask: ``[rows, k]`` int16 chunk-local indices.
        chunk_size: Coordinates per chunk.
        decay: ``1 - lr * weight_decay``.
    """
    if decay != 1.0:
        params.mul_(decay)
    params.index_copy_(0, mask_positions(mask, chunk_size), values.to(params.dtype))
