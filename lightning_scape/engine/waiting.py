"""Saved buckets whose parameters are frozen when the state loads: their state waits for them.

Lightning's ``BaseFinetuning`` freezes the backbone again when a fit resumes (in its ``setup``) and puts back the
param groups it had added (in ``on_fit_start``), all before the optimizer state loads: a bucket of the saved
state may then hold parameters that have not joined the engine. Its state waits, unchanged, as a torch optimizer
keeps the state of a frozen parameter, and the parameters continue from it when they join
(:func:`~lightning_scape.engine.joining.join_trainable_params`):

* all of them at once (a callback that unfreezes them again, or a resume inside the epoch that unfroze them): the
  bucket is laid out as it was saved and its state restored exactly (its masks too, at the step it was saved
  at), so the run goes on as the uninterrupted one did;
* some of them (the BatchNorm layers that ``BaseFinetuning(train_bn=True)`` leaves trainable in a frozen
  backbone): they join in buckets laid out anew, each coordinate's momentum, residual and last-sent step taken
  from the saved bucket (one all-gather of its momentum across the ranks), and the rest waits on.

Steps taken while they wait do not count for them, as they do not count for a frozen parameter under AdamW: the
bucket's first step (AdamS's bias corrections count from it) and its last-sent steps move on by as many steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_scape.comm import Communicator
from lightning_scape.engine.buckets import BucketState
from lightning_scape.engine.layout import Bucket

# What a woken bucket hands the mask schedule: its queued masks and the last one built, as saved.
SavedMasks = tuple[list[Tensor], Tensor | None]


@dataclass(eq=False)
class WaitingBucket:
    """One saved bucket whose parameters had not joined the engine when the state loaded.

    Attributes:
        layout: The saved geometry (param group, size, padding, chunk size); its places hold the parameters, in
            the order they were laid out.
        momentum: This rank's region of the saved momentum, or the whole bucket's once gathered (``full``).
        last_sent: The last-sent steps, in the same form as ``momentum``.
        residual: This rank's residual of the whole bucket.
        masks: The queued masks' indices, as saved.
        last_built: The last built mask's indices, as saved.
        first_step: The step the bucket joined at, as saved.
        saved_step: The engine's step when the state was saved.
        left: The parameters (their ids) whose state is still here: not laid out by a bucket saved before this
            one, nor joined since.
        full: Whether ``momentum`` and ``last_sent`` cover the whole bucket (:meth:`gather`).
    """

    layout: Bucket
    momentum: Tensor
    last_sent: Tensor
    residual: Tensor
    masks: list[Tensor]
    last_built: Tensor | None
    first_step: int
    saved_step: int
    left: set[int] = field(default_factory=set)
    full: bool = False

    @property
    def params(self) -> list[nn.Parameter]:
        """The bucket's parameters, in its order."""
        return [place.param for place in self.layout.places]

    @property
    def whole(self) -> bool:
        """Whether every parameter of the bucket still waits (it can be laid out as it was saved)."""
        return len(self.left) == len(self.layout.places)

    def waiting_numel(self) -> int:
        """The parameters (elements) whose state is still here."""
        return sum(place.numel for place in self.layout.places if id(place.param) in self.left)

    def first_step_at(self, step: int) -> int:
        """The bucket's first step had it joined at ``step``: the steps it waited do not count."""
        return self.first_step + step - self.saved_step

    def last_sent_at(self, step: int, dense_steps: int) -> Tensor:
        """The last-sent steps had the bucket joined at ``step`` (in the form of :attr:`last_sent`).

        Past the warm-up they move on by the steps it waited. A bucket saved inside the warm-up whose wait
        outlasted it counts as sent at ``step``, as a bucket that joins after the warm-up does.
        """
        if self.saved_step >= dense_steps:
            return self.last_sent + (step - self.saved_step)
        if step >= dense_steps:
            return torch.full_like(self.last_sent, step)
        return self.last_sent

    def region(self, rank: int, sharded: bool) -> slice:
        """This rank's region of the saved bucket (sharded: its shard; replicated: the whole bucket)."""
        padded = self.layout.padded_numel
        shard = padded // self.layout.world_size
        return slice(rank * shard, (rank + 1) * shard) if sharded else slice(0, padded)

    def saved_masks(self, step: int, dense_steps: int) -> SavedMasks | None:
        """The saved masks if the bucket joins at the step it was saved at; None: they must be built anew."""
        if step != self.saved_step:
            return None
        if step >= dense_steps and not self.masks and self.last_built is None:
            return None  # saved again after a wait, without masks (:meth:`state`): built when it joins
        return list(self.masks), self.last_built

    @torch.no_grad()
    def restore(self, bs: BucketState, step: int, dense_steps: int, rank: int) -> SavedMasks | None:
        """Give ``bs``, laid out as this bucket was saved, the saved state as of ``step``.

        Returns:
            The masks to keep (:meth:`saved_masks`).
        """
        at = slice(None) if not self.full else self.region(rank, bs.sharded)
        bs.momentum.copy_(self.momentum[at])
        bs.last_sent.copy_(self.last_sent_at(step, dense_steps)[at])
        bs.residual.copy_(self.residual)
        bs.first_step = self.first_step_at(step)
        self.left.clear()
        return self.saved_masks(step, dense_steps)

    @torch.no_grad()
    def gather(self, comm: Communicator, sharded: bool) -> None:
        """Make :attr:`momentum` and :attr:`last_sent` cover the whole bucket: every rank must call it at the same
        point (an all-gather across the ranks, sharded mode; a checkpoint's load, not training traffic: not counted).
        """
        if self.full:
            return
        self.full = True
        if not sharded or comm.world_size == 1:
            return
        pending = []
        for name in ("momentum", "last_sent"):
            mine = getattr(self, name).to(self.layout.device)  # a checkpoint may have been read to the CPU
            whole = mine.new_empty(mine.numel() * comm.world_size)
            pending.append(comm.all_gather(whole, mine))
            setattr(self, name, whole)
        for p in pending:
            p.wait()

    @torch.no_grad()
    def fill(self, bs: BucketState, step: int, dense_steps: int) -> int | None:
        """Give the parameters of ``bs`` that wait here their saved coordinates (after :meth:`gather`).

        Returns:
            The first step they take with them (:meth:`first_step_at`), or None if ``bs`` holds none of them.
        """
        assert self.full, "gather() first: the new bucket's region lies anywhere in the saved one"
        offsets = {id(place.param): place.offset for place in self.layout.places}
        last_sent = self.last_sent_at(step, dense_steps)
        filled = False
        for place in bs.layout.places:
            src = offsets.get(id(place.param))
            if src is None or id(place.param) not in self.left:
                continue
            n = place.numel
            bs.residual[place.offset : place.offset + n] = self.residual[src : src + n]
            _copy_moved(self.momentum, src, bs.momentum, bs.region, place.offset, n)
            _copy_moved(last_sent, src, bs.last_sent, bs.region, place.offset, n)
            self.left.discard(id(place.param))
            filled = True
        return self.first_step_at(step) if filled else None

    def state(self, step: int, dense_steps: int, rank: int, sharded: bool) -> dict[str, Any]:
        """Its tensors, masks and first step for a state saved at ``step``, in the saved form (this rank's region).

        After a wait the masks are left out (they were built for steps that passed: built anew when it joins),
        and the first and last-sent steps have moved on (:meth:`first_step_at`), so that the state saved at
        ``step`` waits on from there.
        """
        at = self.region(rank, sharded) if self.full else slice(None)
        kept = self.saved_masks(step, dense_steps)
        masks, last_built = kept if kept is not None else ([], None)
        return {
            "momentum": self.momentum[at].clone(),
            "residual": self.residual.clone(),
            "last_sent": self.last_sent_at(step, dense_steps)[at].clone(),
            "masks": [m.clone() for m in masks],
            "last_built": None if last_built is None else last_built.clone(),
            "first_step": self.first_step_at(step),
        }


def _copy_moved(src: Tensor, src_offset: int, dst: Tensor, dst_at: slice, dst_offset: int, n: int) -> None:
    """Copy the ``n`` coordinates that start at ``src_offset`` in the whole ``src`` to where they start in the new
    bucket, ``dst_offset``, as far as they lie in ``dst``'s region ``dst_at`` of that bucket."""
    lo, hi = max(dst_at.start, dst_offset), min(dst_at.stop, dst_offset + n)
    if lo < hi:
        dst[lo - dst_at.start : hi - dst_at.start] = src[src_offset + lo - dst_offset : src_offset + hi - dst_offset]
