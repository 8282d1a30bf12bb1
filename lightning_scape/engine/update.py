"""The per-bucket AdamS updates of a step, as pure functions of a bucket, its synced gradient and hyperparameters.

Each function changes only the bucket it is given. The hyperparameters come from one
:class:`~lightning_scape.kernels.AdamSHyper` per param group and step (:func:`step_hyper`), so an LR
scheduler's writes to ``param_group["lr"]`` take effect at the next step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_scape import kernels
from lightning_scape.config import ScapeConfig
from lightning_scape.engine.buckets import BucketState
from lightning_scape.kernels import AdamSHyper


def step_hyper(group: Mapping[str, Any], step: int, config: ScapeConfig, sparse: bool) -> AdamSHyper:
    """The hyperparameters of step ``step`` for one param group.

    Args:
        group: The optimizer's param group (``lr``, ``betas``, ``eps``, ``weight_decay``, optionally
            ``bias_correction``).
        step: The step t being taken (1-based, the dense warm-up included).
        config: The SCAPE configuration (the sparse-step options).
        sparse: A sparse step: the update's learning rate is scaled by ``sparse_lr_scale`` and the catch-up
            and staleness options apply; dense warm-up steps are plain AdamS.
    """
    b1, b2 = group["betas"]
    hyper = AdamSHyper(
        step=step,
        lr=group["lr"],
        beta1=b1,
        beta2=b2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        bias_correction=group.get("bias_correction", True),
    )
    if not sparse:
        return hyper
    return dataclasses.replace(
        hyper,
        lr_update=hyper.lr * config.sparse_lr_scale,
        staleness_correction=config.staleness_correction,
        catch_up=config.catch_up,
        catch_up_cap=config.catch_up_cap,
        interval=config.sparse_update == "interval",
        interval_cap=config.interval_cap,
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


def sparse_update(
    bucket: BucketState, mask: Tensor, averaged: Tensor, hyper: AdamSHyper, unmasked_momentum: bool
) -> None:
    """A sparse step: AdamS on the region's masked slots from their averaged values, into ``bucket.updated``.

    The parameters themselves are written by :func:`apply_sparse`, except with ``unmasked_momentum``
    (``unmasked_update="momentum"``, replicated only): every unmasked coordinate then takes AdamS's step with
    g = 0 here (its momentum decays and it moves along it), and the masked ones keep their own update.

    Args:
        bucket: The bucket.
        mask: The whole bucket's mask of this step, ``[chunks, k]`` int16.
        averaged: ``[region_slots]`` averaged values of the region's slots, in mask order.
        hyper: The step's hyperparameters (:func:`step_hyper` with ``sparse=True``).
        unmasked_momentum: Move the unmasked coordinates along their momentum.
    """
    C = bucket.layout.chunk_size
    rows = bucket.region_rows(mask)
    kernels.sparse_adams(
        bucket.region_params, bucket.momentum, bucket.last_sent, averaged, rows, C, bucket.updated, hyper
    )
    if unmasked_momentum:
        pos = kernels.mask_positions(rows, C)
        m_slots = bucket.momentum.index_select(0, pos)
        kernels.dense_adams(bucket.params, bucket.momentum, None, hyper)
        bucket.momentum.index_copy_(0, pos, m_slots)


def apply_sparse(bucket: BucketState, mask: Tensor, decay: float) -> None:
    """Every rank: decay the whole replica by ``decay``, then write the new values at the mask."""
    kernels.scatter_decay(bucket.params, bucket.scatter_source(), mask, bucket.layout.chunk_size, decay)
