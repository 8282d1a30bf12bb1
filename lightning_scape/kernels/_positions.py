"""Chunk-local int16 mask indices -> flat positions (shared by the reference ops)."""

from __future__ import annotations

import torch
from torch import Tensor

# A chunk-local index is stored as int16, so a chunk holds at most 2**15 coordinates.
MAX_CHUNK_SIZE = 32768


def mask_positions(mask: Tensor, chunk_size: int) -> Tensor:
    """Flat int64 positions of a mask.

    Args:
        mask: ``[rows, k]`` chunk-local indices (int16), row ``i`` addressing chunk ``i`` of a flat
            buffer cut into ``chunk_size`` pieces.
        chunk_size: Coordinates per chunk.

    Returns:
        ``[rows * k]`` int64 positions ``i * chunk_size + mask[i, j]``, in row-major order (the order of
        the compact buffers).
    """
    rows = mask.shape[0]
    base = torch.arange(rows, device=mask.device, dtype=torch.int64).mul_(chunk_size).unsqueeze(1)
    return (mask.to(torch.int64) + base).reshape(-1)
