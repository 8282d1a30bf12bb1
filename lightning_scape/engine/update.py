"""The per-bucket AdamS updates of a step, as pure functions of a bucket, its synced gradient and hyperparameters.

Each function changes only the bucket it is given. The hyperparameters come from one
:class:`~lightning_scape.kernels.AdamSHyper` per param group and step (:func:`step_hyper`), so an LR
scheduler's writes to ``param_group["lr"]`` take effect at the next step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_scape import kernels
from lightning_scape.comm import Pending, Wire
from lightning_scape.config import ScapeConfig
from lightning_scape.engine.buckets import BucketState
from lightning_scape.kernels import AdamSHyper


def step_hyper(group: Mapping[str, Any], step: int, config: ScapeConfig, peak_lr: float | None) -> AdamSHyper:
    """The hyperparameters of step ``step`` for one param group.

    Args:
        group: The optimizer's param group (``lr``, ``betas``, ``eps``, ``weight_decay``, optionally
            ``bias_correction``).
        step: The step t being taken (1-based, the dense warm-up included).
        config: The SCAPE configuration.
        peak_lr: Sparse steps: the group's peak learning rate so far; ``catch_up_cap`` counts steps at it, so
            at this step's learning rate the cap is ``catch_up_cap * peak_lr / lr`` steps. None: a dense step.
    """
    b1, b2 = group["betas"]
    lr = group["lr"]
    cap = math.inf
    if peak_lr is not None and lr > 0:
        cap = config.catch_up_cap * max(peak_lr, lr) / lr
    return AdamSHyper(
        step=step,
        lr=lr,
        beta1=b1,
        beta2=b2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        bias_correction=group.get("bias_correction", True),
        catch_up_cap=cap,
    )


def clip_(synced: list[Tensor], coef: Tensor | None, clip_value: float | None) -> None:
    """Scale the synced gradients by the global-norm coefficient, then clamp them to ``[-clip_value, clip_value]``."""
    for g in synced:
        if coef is not None:
            g.mul_(coef.to(g.dtype))
        if clip_value is not None:
            g.clamp_(-clip_value, clip_value)


def dense_update(bucket: BucketState, grad: Tensor, hyper: AdamSHyper) -> None:
    """A warm-up step: AdamS on the region's parameters, in place, from the averaged gradient ``grad``."""
    kernels.dense_adams(bucket.region_params, bucket.momentum, grad, hyper)


def sparse_update(bucket: BucketState, mask: Tensor, averaged: Tensor, hyper: AdamSHyper) -> None:
    """A sparse step: the interval update of the region's masked slots, into ``bucket.updated``.

    The parameters themselves are written by :func:`apply_sparse`, on every rank.

    Args:
        bucket: The bucket.
        mask: The whole bucket's mask of this step, ``[chunks, k]`` int16.
        averaged: ``[region_slots]`` averaged values of the region's slots, in mask order.
        hyper: The step's hyperparameters (:func:`step_hyper` with a peak learning rate).
    """
    rows = bucket.region_rows(mask)
    kernels.sparse_adams(
        bucket.region_params,
        bucket.momentum,
        bucket.last_sent,
        averaged,
        rows,
        bucket.layout.chunk_size,
        bucket.updated,
        hyper,
    )


def launch_param_gather(bucket: BucketState, wire: Wire, dense: bool) -> Pending | None:
    """Sharded mode: every owner's updated values to every rank (replicated mode has the parameters already).

    Dense: the updated shard (the consumed gradient shard is reused as the send buffer); sparse: the new values
    at the region's slots.
    """
    if not bucket.sharded:
        return None
    if dense:
        send = bucket.dense_synced()
        send.copy_(bucket.region_params)
        return wire.all_gather("dense", bucket.params, send)
    assert bucket.gathered is not None
    return wire.all_gather("params", bucket.gathered, bucket.updated)


def apply_sparse(bucket: BucketState, mask: Tensor, decay: float) -> None:
    """Every rank: decay the whole replica by ``decay``, then write the new values at the mask."""
    kernels.scatter_decay(bucket.params, bucket.scatter_source(), mask, bucket.layout.chunk_size, decay)
