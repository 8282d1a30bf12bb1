"""Parameters joining an engine: at construction, and later when they become trainable.

A parameter joins when it is in one of the optimizer's param groups and requires a gradient: at construction,
or later, when it is unfrozen or its param group is added to the optimizer (what Lightning's
``BaseFinetuning`` does). Later parameters get buckets of their own, appended after the others, so nothing
that is already laid out moves: their momentum and residual start at zero, during the dense warm-up they are
sent dense like the others, and after it they are sent sparsely at once, with a mask built when they join
and the coordinates counted as sent at that step. Every rank must add them at the same point, between two
steps: building their first masks is a collective.

Parameters whose state a checkpoint saved while they wait to join (:mod:`~lightning_scape.engine.waiting`)
continue from it instead: a saved bucket whose parameters are all trainable again is laid out as it was saved,
before any new bucket; parameters of one that is only partly trainable join new buckets with their saved
coordinates' state.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from lightning_scape.engine import form_switch
from lightning_scape.engine.buckets import BucketState
from lightning_scape.engine.layout import Bucket, build_buckets
from lightning_scape.engine.waiting import SavedMasks, WaitingBucket

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
            # Two hooks per parameter, appended in bucket order: unbind() removes a bucket's from the end.
            engine._hooks.append(place.param.register_hook(functools.partial(engine._on_grad_arriving, layout.index)))
            engine._hooks.append(place.param.register_post_accumulate_grad_hook(engine._on_grad_ready))
        engine.buckets.append(bs)
        new.append(bs)
    _count(engine)
    return new


def _count(engine: ScapeEngine) -> None:
    engine.numel = sum(b.layout.numel for b in engine.buckets)
    engine.padded_numel = sum(b.layout.padded_numel for b in engine.buckets)


@torch.no_grad()
def unbind(engine: ScapeEngine, keep: int) -> None:
    """Undo the binding of every bucket after the first ``keep``: their parameters get storage of their own again,
    without a gradient or the engine's hooks, and are laid out anew when they join next.

    For a state that loads (:func:`~lightning_scape.engine.state.load_engine_state`), whose layout decides where
    parameters that joined since the engine's construction belong; the state then replaces what these buckets
    held. Never the buckets of the construction (:attr:`ScapeEngine.fixed_buckets`): code may hold their buffers.
    """
    assert keep >= engine.fixed_buckets and engine._step is None
    for bs in reversed(engine.buckets[keep:]):
        for place in reversed(bs.layout.places):
            for _ in range(2):
                engine._hooks.pop().remove()
            p = place.param
            p.data = p.data.clone()
            p.grad = None
            del engine._bucket_index[id(p)]
    del engine.buckets[keep:]  # in place: the mask schedule reads the same list
    engine.masks.truncate(keep)
    _count(engine)


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
    # Saved buckets whose parameters are all trainable again: laid out as saved, before any new bucket.
    woken = [w for w in engine.waiting if w.whole and all(p.requires_grad for p in w.params)]
    taken = {id(p) for w in woken for p in w.params}
    pending: list[dict[str, object]] = [
        {"params": [p for p in g["params"] if id(p) not in engine._bucket_index and id(p) not in taken]} for g in groups
    ]
    cfg = engine.config
    layouts = build_buckets(pending, engine.world_size, cfg.chunk_size, cfg.bucket_cap_mb, engine.param_order)
    if not layouts and not woken:
        return 0
    if engine._step is not None:
        raise RuntimeError(
            "SCAPE: parameters became trainable (unfrozen, or a param group was added) between a backward pass and "
            "its optimizer step, so their gradients of this step were never sent. Unfreeze them or add their param "
            "group between steps (Lightning's BaseFinetuning does it at the start of an epoch)."
        )
    form_switch.shard_again(engine)  # the new buckets are sharded: the pilot's next dense step gathers them all
    engine.waiting = [w for w in engine.waiting if w not in woken]
    new = bind(engine, [w.layout for w in woken] + layouts)
    restored, fresh = new[: len(woken)], new[len(woken) :]
    if engine.sync_params:
        sync_from_rank0(engine, fresh)  # restored ones hold the checkpoint's values, the same on every rank
    kept: dict[int, SavedMasks] = {}
    for bs, w in zip(restored, woken, strict=True):
        bs.grads.zero_()
        masks = w.restore(bs, engine.step_count, cfg.dense_steps, engine.rank)
        if masks is not None:
            kept[bs.layout.index] = masks
    for bs in fresh:
        bs.grads.zero_()  # a gradient computed before they joined was not sent: it is not applied either
        bs.first_step = engine.step_count  # their momentum starts now: its bias corrections count from here
        if not engine.in_warmup:
            bs.last_sent.fill_(engine.step_count)
    _continue_waiting(engine, fresh)
    engine.masks.add_buckets(new, engine.step_count, kept)
    return sum(b.layout.numel for b in new)


def _continue_waiting(engine: ScapeEngine, fresh: list[BucketState]) -> None:
    """Give parameters of new buckets whose state waited in a saved bucket (only part of which is trainable) their
    saved coordinates' momentum, residual and last-sent steps, and the bucket's first step (the earliest, when a
    new bucket holds parameters of several). Every rank does it at the same point (:meth:`WaitingBucket.gather`)."""
    joined = {id(place.param) for bs in fresh for place in bs.layout.places}
    still: list[WaitingBucket] = []
    for w in engine.waiting:
        if w.left & joined:
            w.gather(engine.comm, engine.config.sharded)
            for bs in fresh:
                first = w.fill(bs, engine.step_count, engine.config.dense_steps)
                if first is not None:
                    bs.first_step = min(bs.first_step, first)
        if w.left:
            still.append(w)
    engine.waiting = still


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
