"""Memory per rank: parameters, gradients, optimizer state and communication buffers (activations excluded).

SCAPE's numbers are the sizes of the engine's own buffers: a
:class:`~lightning_scape.engine.buckets.BucketState` is built for every bucket on the meta device (shapes
and dtypes, no memory), with its compact buffers at their capacity, plus the masks the schedule holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_scape.config import ScapeConfig
from lightning_scape.engine.buckets import BucketState
from lightning_scape.engine.layout import Bucket

INDEX_ITEMSIZE = 2  # int16 mask indices


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds for training, activations excluded.

    Attributes:
        params: The parameters.
        grads: The gradients.
        optimizer: The optimizer's state (AdamW: two moments; SCAPE: residual, momentum shard, last-sent steps).
        buffers: Communication buffers at their largest (DDP: its gradient buckets; SCAPE: the compact buffers
            and the masks of the density ramp's first step, or the warm-up's gradient shard if larger).
    """

    params: int
    grads: int
    optimizer: int
    buffers: int

    @property
    def total(self) -> int:
        """All of it."""
        return self.params + self.grads + self.optimizer + self.buffers


def ddp_memory(param_groups: list[dict[str, Any]], gradient_as_bucket_view: bool = False) -> Memory:
    """DDP + AdamW: parameters, gradients, DDP's bucket copy of the gradients, and AdamW's two moments.

    Args:
        param_groups: The trainable parameters.
        gradient_as_bucket_view: DDP's option (False in PyTorch and Lightning): True makes the gradients views
            into the buckets, saving the copy.
    """
    nbytes = sum(p.numel() * p.element_size() for g in param_groups for p in g["params"])
    return Memory(params=nbytes, grads=nbytes, optimizer=2 * nbytes, buffers=0 if gradient_as_bucket_view else nbytes)


def _size(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def scape_memory(layout: Sequence[Bucket], config: ScapeConfig, rank: int = 0) -> Memory:
    """SCAPE's buffers on rank ``rank``, from the engine's :class:`~lightning_scape.engine.buckets.BucketState`.

    Args:
        layout: The engine's buckets (any device: they are rebuilt on the meta device).
        config: The configuration; where it leaves the form to SCAPE or sends every step dense in fp32, sized at the
            most it holds: the momentum of every parameter, as fp32 dense steps in DDP's form hold it
            (``docs/self_driving.md``).
        rank: The rank (every rank holds the same sizes).
    """
    totals = [0] * 6  # params, grads, optimizer state, compact buffers, masks, warm-up shard
    seen: dict[tuple[Any, ...], list[int]] = {}  # buckets of one shape hold the same (a large model has thousands)
    for bucket in layout:
        key = (bucket.padded_numel, bucket.chunk_size, bucket.dtype, bucket.world_size)
        if key not in seen:
            seen[key] = _bucket_bytes(bucket, config, rank)
        totals = [a + b for a, b in zip(totals, seen[key], strict=True)]
    params, grads, optimizer, compact, masks, shard = totals
    return Memory(params=params, grads=grads, optimizer=optimizer, buffers=compact + max(masks, shard))


def _bucket_bytes(bucket: Bucket, config: ScapeConfig, rank: int) -> list[int]:
    """One bucket's params, grads, optimizer state, compact buffers, masks and warm-up shard, in bytes."""
    # Every momentum on every rank: the fp32 dense steps in DDP's form (of the defaults, or fixed for the whole run).
    ddp_form = (config.chooses_form or config.every_step_dense_fp32) and config.sharded and bucket.world_size > 1
    config = config.start_form()
    bs = BucketState(dataclasses.replace(bucket, device=torch.device("meta")), config, rank)
    if ddp_form:
        bs.replicate(torch.zeros(bucket.padded_numel, dtype=bs.momentum.dtype, device="meta"))
    cap = config.max_slots(bucket.chunk_size)
    bs.k = cap  # the compact buffers are views of this size into buffers allocated for the largest k
    masks_held = config.mask_delay + 1  # the mask in use and the ones queued behind it
    # The warm-up's reduce-scatter output (sharded), freed when the warm-up ends, before the first mask.
    shard = bucket.shard_numel * bucket.dtype.itemsize if config.sharded else 0
    return [
        _size(bs.params),
        _size(bs.grads),
        _size(bs.residual, bs.momentum, bs.last_sent),
        _size(bs.values, bs.received, bs.updated, bs.gathered),
        masks_held * bucket.chunks * cap * INDEX_ITEMSIZE,
        shard,
    ]
