"""The per-bucket AdamS updates of a step, as pure functions of a bucket, its synced gradient and hyperparameters.

Each function changes only the bucket it is given. The hyperparameters come from one
:class:`~lightning_scape.kernels.AdamSHyper` per param group and step (:func:`step_hyper`), so an LR
scheduler's writes to ``param_group["lr"]`` take effect at the next step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
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


def step_hypers(
    groups: list[dict[str, Any]], step: int, config: ScapeConfig, peak_lr: list[float], sparse: bool
) -> tuple[list[AdamSHyper], list[float]]:
    """Per param group, :func:`step_hyper` of step ``step``, and each group's peak learning rate with this step's.

    Args:
        groups: The optimizer's param groups.
        step: The step t being taken.
        config: The SCAPE configuration.
        peak_lr: Per group, the largest learning rate of the steps before.
        sparse: Whether the step is sparse (the interval update's cap applies).
    """
    peaks = [max(peak, g["lr"]) for peak, g in zip(peak_lr, groups, strict=True)]
    hypers = [step_hyper(g, step, config, peak if sparse else None) for g, peak in zip(groups, peaks, strict=True)]
    return hypers, peaks


def for_bucket(hypers: list[AdamSHyper], bucket: BucketState) -> AdamSHyper:
    """The hyperparameters of ``bucket``'s param group, its bias corrections counted from the step it joined."""
    hyper = hypers[bucket.layout.group_index]
    return hyper if bucket.first_step == 0 else dataclasses.replace(hyper, first_step=bucket.first_step)


def clip_(synced: list[Tensor], coef: Tensor | None, clip_value: float | None) -> None:
    """Scale the synced gradients by the global-norm coefficient, then clamp them to ``[-clip_value, clip_value]``."""
    cast: dict[torch.dtype, Tensor] = {}  # the coefficient in each gradient dtype, cast once for every bucket
    for g in synced:
        if coef is not None:
            if g.dtype not in cast:
                cast[g.dtype] = coef.to(g.dtype)
            g.mul_(cast[g.dtype])
        if clip_value is not None:
            g.clamp_(-clip_value, clip_value)


def dense_update(bucket: BucketState, grad: Tensor, hyper: AdamSHyper, wire: Wire) -> Pending | None:
    """A dense step: AdamS on the region's parameters from the averaged gradient ``grad``; sharded mode launches
    the all-gather that brings every owner's new values to every rank (:func:`launch_param_gather`)."""
    if bucket.int8_wire:
        return _dense_update_int8(bucket, grad, hyper, wire)
    kernels.dense_adams(bucket.region_params, bucket.momentum, grad, hyper)
    return launch_param_gather(bucket, wire, dense=True)


def sparse_update(bucket: BucketState, mask: Tensor, averaged: Tensor, hyper: AdamSHyper, wire: Wire) -> Pending | None:
    """A sparse step: the interval update of the region's masked slots, into ``bucket.updated``; sharded mode
    launches the all-gather of every owner's new values.

    The parameters themselves are written by :func:`apply_sparse`, on every rank.

    Args:
        bucket: The bucket.
        mask: The whole bucket's mask of this step, ``[chunks, k]`` int16.
        averaged: ``[region_slots]`` averaged values of the region's slots, in mask order.
        hyper: The step's hyperparameters (:func:`step_hyper` with a peak learning rate).
        wire: The group's collectives.
    """
    kernels.sparse_adams(
        bucket.region_params,
        bucket.momentum,
        bucket.last_sent,
        averaged,
        bucket.region_rows(mask),
        bucket.layout.chunk_size,
        bucket.updated,
        hyper,
    )
    if bucket.int8_wire:
        return _launch_change_gather_int8(bucket, mask, hyper.decay, wire)
    return launch_param_gather(bucket, wire, dense=False)


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


def _dense_update_int8(bucket: BucketState, grad: Tensor, hyper: AdamSHyper, wire: Wire) -> Pending:
    """The int8 wire's dense step: the owner computes the new values aside and sends their change from the values
    every rank holds; every rank, the owner too, adds the decoded changes when the gather completes, so the
    replicas stay bitwise equal."""
    region = bucket.region_params
    new = region.clone()
    kernels.dense_adams(new, bucket.momentum, grad, hyper)
    change = grad  # the synced gradient is consumed: its buffer takes the change (then its rounding error)
    change.copy_(new).sub_(region)
    return wire.all_gather_int8("dense", bucket.params, change, bucket.dense_int8_group)


def _launch_change_gather_int8(bucket: BucketState, mask: Tensor, decay: float, wire: Wire) -> Pending:
    """The int8 wire's sparse step: the owners' new values at the mask, sent as int8 changes.

    Every rank starts ``gathered`` at what it holds at the mask after the weight decay, ``decay * params``, and
    adds every owner's decoded change to it; :func:`apply_sparse` then writes it. The owner sends the change from
    that same value, so the replicas stay bitwise equal.
    """
    C = bucket.layout.chunk_size
    gathered = bucket.gathered
    assert gathered is not None
    torch.index_select(bucket.params, 0, bucket.mask_positions(mask), out=gathered)
    if decay != 1.0:  # without weight decay the values are what decaying leaves (scatter_decay skips it too)
        gathered.mul_(decay)
    region = slice(bucket.region.start // C * bucket.k, bucket.region.stop // C * bucket.k)
    # Taken before the gather adds to ``gathered``: its region holds the decayed values the owner's change is from.
    change = bucket.updated.sub_(gathered[region])
    return wire.all_gather_int8("params", gathered, change, bucket.k, bucket.params_packets)


def apply_sparse(bucket: BucketState, mask: Tensor, decay: float) -> None:
    """Every rank: decay the whole replica by ``decay``, then write the new values at the mask."""
    kernels.scatter_decay(bucket.params, bucket.scatter_source(), mask, bucket.layout.chunk_size, decay)
