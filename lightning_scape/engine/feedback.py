"""Error feedback: what a sparse step sends, and the residual that keeps everything it did not send.

``a = e + g``; the compact buffer takes ``v = a[mask]`` (cast to the communication dtype) and the residual
becomes ``e = a`` with ``e[mask] = a[mask] - v``: the unsent gradient whole, and at the sent coordinates only
the rounding error of the cast. For every coordinate, the local gradient summed over all steps equals what
was sent plus the residual, exactly.

A step that may still be skipped (fp16 loss scaling: a rank saw inf/nan) is split in two: :func:`stage`
fills the compact buffer without touching the residual, and :func:`commit` applies the residual's half once
every rank agreed that the step is finite. Both halves together equal :func:`compact`, bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_scape import kernels
from lightning_scape.engine.buckets import BucketState


def compact(bucket: BucketState, mask: Tensor) -> None:
    """Error feedback and compaction in one pass (``kernels.ef_compact``): fills ``values``, updates ``residual``."""
    kernels.ef_compact(bucket.residual, bucket.grads, mask, bucket.layout.chunk_size, bucket.values)


def keep_rounding_error(bucket: BucketState, mask: Tensor) -> None:
    """The int8 wire: ``values`` now holds what the int8 codes did not carry; the residual takes it back."""
    bucket.residual.index_add_(0, bucket.mask_positions(mask), bucket.values.to(bucket.residual.dtype))


def stage(bucket: BucketState, mask: Tensor) -> None:
    """Fill ``values`` with ``(e + g)[mask]`` and leave the residual untouched (the same values as :func:`compact`)."""
    pos = bucket.mask_positions(mask)
    bucket.values.copy_(bucket.residual.index_select(0, pos).add_(bucket.grads.index_select(0, pos)))


def commit(bucket: BucketState, mask: Tensor) -> None:
    """The residual's half of a staged step: :func:`compact`'s arithmetic, its compact output discarded.

    ``values`` may hold the all-reduced sums by now (replicated mode), so the recomputed compact values go
    to a scratch buffer; they equal what :func:`stage` sent. With the int8 wire, ``values`` holds the rounding
    error of what was sent, which the residual then takes back (:func:`keep_rounding_error`).
    """
    scratch = torch.empty_like(bucket.values)
    kernels.ef_compact(bucket.residual, bucket.grads, mask, bucket.layout.chunk_size, scratch)
    if bucket.int8_wire:  # the int8 launch left its rounding error in ``values``
        keep_rounding_error(bucket, mask)


def residual_norm(buckets: list[BucketState]) -> float:
    """L2 norm of this rank's error-feedback residual over ``buckets``."""
    return float(torch.stack([bs.residual.float().norm() for bs in buckets] or [torch.zeros(())]).norm())


def oldest_unsent_age(buckets: list[BucketState], step_count: int, in_warmup: bool) -> int:
    """Steps since the least recently sent coordinate of this rank's region was last sent (0 in the dense warm-up,
    whose steps send every coordinate)."""
    if in_warmup:
        return 0
    return max((int(step_count - bs.last_sent.min().item()) for bs in buckets), default=0)
