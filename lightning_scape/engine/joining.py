"""Parameters joining an engine: at construction, and later when they become trainable.

A parameter joins when it is in one of the optimizer's param groups and requires a gradient: at construction,
or later, when it is unfrozen or its param group is added to the optimizer (what Lightning's
``BaseFinetuning`` does). Later parameters get buckets of their own, appended after the others, so nothing
that is already laid out moves: their momentum and residual start at zero, during the dense warm-up they are
sent dense like the others, and after it they are sent sparsely at once, with a mask built when they join
and the coordinates counted as sent at that step. Every rank must add them at the same point, between two
steps: building their first masks is a collective.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from lightning_scape.engine.buckets import BucketState
from lightning_scape.engine.layout import Bucket, build_buckets

if TYPE_CHECKING:
    from lightning_scape.engine import ScapeEngine


def bind(engine: ScapeEngine, layouts: list[Bucket]) -> list[BucketState]:
    """Make ``layouts`` the engine's next buckets: the parameters become views of their flat buffers, and each
    gets the gradient hooks that launch its bucket's collective.

    Args:
        engine: The engine (its ``buckets`` grow in place: the mask schedule and every step read that list).
        layouts: The new buckets' geometry (:func:`~lightning_scape.engine.layout.build_buckets`).

    Returns:
        The new buckets.
    """
    new = []
    for layout in layouts:
        layout.index = len(engine.buckets)
        bs = BucketState(layout, engine.config, engine.rank)
        bs.bind_params()
        for place in layout.places:
            engine._bucket_index[id(place.param)] = layout.index
            # Before a gradient accumulates (a second backward pass: StepInFlight.reopen), and after (launch).
            engine._hooks.append(place.param.register_hook(functools.partial(engine._on_grad_arriving, layout.index)))
            engine._hooks.append(place.param.register_post_accumulate_grad_hook(engine._on_grad_ready))
        engine.buckets.append(bs)
        new.append(bs)
    engine.numel = sum(b.layout.numel for b in engine.buckets)
    engine.padded_numel = sum(b.layout.padded_numel for b in engine.buckets)
    return new


@torch.no_grad()
def join_trainable_params(engine: ScapeEngine) -> int:
    """Lay out the trainable parameters of the engine's optimizer that it does not hold yet.

    Args:
        engine: The engine; its optimizer's param groups may have grown, or parameters in them been unfrozen.

    Returns:
        The number of parameters that joined (0: none).

    Raises:
        RuntimeError: Parameters became trainable while a step is in flight (after a backward pass, before the
            optimizer step): their gradient of this step was never sent.
    """
    groups = engine.optimizer.param_groups
    engine.peak_lr += [0.0] * (len(groups) - len(engine.peak_lr))
    waiting: list[dict[str, object]] = [
        {"params": [p for p in g["params"] if id(p) not in engine._bucket_index]} for g in groups
    ]
    cfg = engine.config
    layouts = build_buckets(waiting, engine.world_size, cfg.chunk_size, cfg.bucket_cap_mb, engine.param_order)
    if not layouts:
        return 0
    if engine._step is not None:
        raise RuntimeError(
            "SCAPE: parameters became trainable (unfrozen, or a param group was added) between a backward pass and "
            "its optimizer step, so their gradients of this step were never sent. Unfreeze them or add their param "
            "group between steps (Lightning's BaseFinetuning does it at the start of an epoch)."
        )
    new = bind(engine, layouts)
    if engine.sync_params:
        sync_from_rank0(engine, new)
    for bs in new:
        bs.grads.zero_()  # a gradient computed before they joined was not sent: it is not applied either
        bs.first_step = engine.step_count  # their momentum starts now: its bias corrections count from here
        if not engine.in_warmup:
            bs.last_sent.fill_(engine.step_count)
    engine.masks.add_buckets(new, engine.step_count)
    return sum(b.numel for b in layouts)


@torch.no_grad()
def sync_from_rank0(engine: ScapeEngine, buckets: list[BucketState]) -> None:
    """Rank 0's parameters of ``buckets`` everywhere: the others contribute zeros to one all-reduce (exact)."""
    if engine.world_size == 1:
        return
    pending = []
    for bs in buckets:
        if engine.rank != 0:
            bs.params.zero_()
        pending.append(engine.wire.all_reduce_sum("setup", bs.params))
    for p in pending:
        engine.wire.wait(p)
