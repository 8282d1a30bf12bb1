"""Error feedback + compaction: ``a = e + g; v = a[mask]; e = a; e[mask] -= v``, in one pass.

The residual ``e`` keeps whatever the compact buffer did not carry: the unmasked coordinates whole, and
at masked coordinates the rounding error of casting ``a`` to the communication dtype (zero in fp32). So
for every coordinate, the local gradient summed over steps equals what was sent plus the residual.
"""

from __future__ import annotations

from torch import Tensor

from ._positions import mask_positions


def ef_compact_ref(residual: Tensor, grad: Tensor, mask: Tensor, chunk_size: int, out: Tensor) -> None:
    """Pure-PyTorch reference (and CPU path).

    Args:
        residual: ``[rows * chunk_size]`` error-feedback residual (fp32 or fp64), updated in place.
        grad: Same shape, this step's local gradient (any float dtype).
        mask: ``[rows, k]`` int16 chunk-local indices.
        chunk_size: Coordinates per chunk.
        out: ``[rows * k]`` compact buffer in the communication dtype, written in mask order.
    """
    residual.add_(grad)
    pos = mask_positions(mask, chunk_size)
    picked = residual.index_select(0, pos)
    out.copy_(picked)
    residual.index_copy_(0, pos, picked.sub_(out.to(residual.dtype)))
