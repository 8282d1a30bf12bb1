"""One optimizer step in flight, from its first gradient hook to the end of ``ScapeEngine.step``.

It launches the buckets' value collectives strictly in bucket order (so every rank issues the same
sequence even when a parameter is unused on one rank), waits for them once, and holds what the step
derives from them: the averaged gradients, their global norm and the ranks' agreement on finiteness. A new
one is made when a step opens and dropped when the step closes, so nothing leaks from one step to the next.

Several backward passes before one step add up, as under DDP. The collectives never write the gradient
buffers (``param.grad`` keeps this rank's gradient), so when a gradient arrives for a bucket that was already
launched, :meth:`StepInFlight.reopen` waits for every launch, folds what they synchronised back into local
state and starts a new round of launches from the accumulated gradients: dense steps and staged sparse steps
send the whole accumulated gradient again (the first round's result is discarded); a sparse step whose
residual already took the first round's gradient keeps that round's averaged values (``carry``) and sends
only what came since, so no gradient mass is lost or counted twice.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_scape.comm import Pending, Wire
from lightning_scape.config import ScapeConfig
from lightning_scape.engine import feedback
from lightning_scape.engine.buckets import BucketState
from lightning_scape.engine.masks import MaskSchedule


class StepInFlight:
    """The launches, waits and synchronised gradients of step ``step``.

    Args:
        buckets: The engine's buckets.
        config: The SCAPE configuration.
        wire: The group's collectives, counted (bytes and wait times).
        masks: The mask schedule (sparse steps send at its masks).
        step: The step t being taken (1-based).
        dense: A dense warm-up step (the whole gradient is averaged) rather than a sparse one.
        loss_scale: The fp16 loss scale this step's gradients carry, divided out at launch; None: unscaled.
        skip_nonfinite: Check the gradients for inf/nan, and defer the residual's update until every rank
            agreed that the step is finite (:func:`~lightning_scape.engine.feedback.stage`).
    """

    def __init__(
        self,
        buckets: list[BucketState],
        config: ScapeConfig,
        wire: Wire,
        masks: MaskSchedule,
        step: int,
        dense: bool,
        loss_scale: float | None,
        skip_nonfinite: bool,
    ) -> None:
        self.buckets, self.config, self.wire, self.masks = buckets, config, wire, masks
        self.step, self.dense, self.loss_scale, self.skip_nonfinite = step, dense, loss_scale, skip_nonfinite
        n = len(buckets)
        self.ready = [0] * n  # per bucket: gradients that have arrived
        self.pending: list[Pending | None] = [None] * n  # per bucket: the value collective in flight
        self.next_launch = 0  # buckets below this index are launched (in the current round)
        self.rounds = 1  # rounds of launches: a backward pass that reaches launched buckets starts one
        self.carry: list[Tensor | None] = [None] * n  # per bucket: the averaged values of earlier rounds
        self.staged: list[Tensor | None] = [None] * n  # int8 wire, dense, skip_nonfinite: the residual to commit
        self.folded = [False] * n  # fp32 dense: the bucket's residual went out with its gradient
        self.sent_versions = [-1] * n  # per bucket: the gradient buffer's version when it was launched
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=buckets[0].params.device)
        self._synced: list[Tensor] | None = None
        self._squared_norm: Tensor | None = None
        wire.counters.start_step()

    # ------------------------------------------------------------------ launches

    def launched(self, i: int) -> bool:
        """Whether bucket ``i``'s collective of the current round was launched."""
        return i < self.next_launch

    def grad_ready(self, i: int) -> None:
        """A gradient of bucket ``i`` arrived (a backward hook); launch every bucket that is complete."""
        if self.launched(i):
            # reopen() runs before a gradient accumulates into a launched bucket; only a gradient that bypassed
            # that hook (written outside autograd's accumulation) gets here, and it can no longer be separated.
            raise RuntimeError(
                "SCAPE: a gradient arrived for a bucket that was already sent this step without passing autograd's "
                "accumulation, so it cannot join this step. Accumulate it without sending: wrap all but the last "
                "backward pass of the step in `optimizer.toggle_model(sync_grad=False)` or "
                "`trainer.strategy.block_backward_sync()` (Trainer), `fabric.no_backward_sync(model)` (Fabric), or "
                "`engine.no_sync()`."
            )
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i].layout.places):
            self.launch_in_order(all_buckets=False)

    def launch_in_order(self, all_buckets: bool) -> None:
        """Launch complete buckets (every bucket with ``all_buckets``) strictly in index order."""
        while self.next_launch < len(self.buckets):
            i = self.next_launch
            if not all_buckets and self.ready[i] < len(self.buckets[i].layout.places):
                return
            self.pending[i] = self._launch(i)
            self.next_launch += 1

    def reopen(self) -> None:
        """Start a new round: another backward pass is about to add gradients to buckets launched this step.

        Called before any of the new gradients accumulates. Every bucket is launched (in index order, so every
        rank issues the same collectives) and waited for; then what those rounds synchronised is folded back
        and the buckets launch again, from their accumulated gradients, as the new gradients complete them.
        Dense and staged sparse steps send the accumulated gradient whole again (the earlier result is
        discarded). A sparse step whose residual took the gradient ``g`` at launch (``e' = e + g - v``) keeps
        the averaged values as ``carry`` and takes ``g`` back out of the residual: the next launch adds the
        accumulated gradient ``g + g2`` and sends ``(e' + g2)[mask]``, only what is new. The fp16 loss scale
        that the launches divided out is multiplied back in, to match the scaled gradients still to come.
        """
        self.launch_in_order(all_buckets=True)
        synced = self.synced_grads()
        for i, (bs, g) in enumerate(zip(self.buckets, synced, strict=True)):
            if self.residual_took_grads:
                self.carry[i] = g.clone()  # synced_grads added the carry of earlier rounds already
                bs.residual.sub_(bs.grads)
            elif self.folded[i] and not self.skip_nonfinite:
                bs.residual.sub_(bs.grads)  # the launch added it to the residual it sent; the next adds it again
            if self.loss_scale is not None and self.loss_scale != 1.0:
                bs.grads.mul_(self.loss_scale)
        n = len(self.buckets)
        self.ready = [0] * n
        self.pending = [None] * n
        self.next_launch = 0
        self._synced = self._squared_norm = None
        self.rounds += 1

    @property
    def residual_took_grads(self) -> bool:
        """Whether a launch put the gradient into the residual (``e' = e + g - v``): sparse steps, and the int8
        wire's dense steps, unless the step may still be skipped (then the residual waits, :func:`feedback.stage`)."""
        return (not self.dense or self.config.wire_format == "int8") and not self.skip_nonfinite

    def commit_staged(self) -> None:
        """Every rank agreed that the step is finite: staged int8 dense launches hand their residuals over."""
        for bs, a in zip(self.buckets, self.staged, strict=True):
            if a is not None:
                bs.residual.copy_(a)

    def close(self, applied: bool) -> None:
        """The step is over: a dense step gives back what :meth:`~BucketState.dense_synced` borrowed; an applied
        one that sent a residual leaves it empty, and one that sent values leaves it live."""
        if self.dense:
            for bs in self.buckets:
                bs.end_dense_step()
        if not applied:
            return
        into_residual = not self.dense or self.config.wire_format == "int8"
        for bs, folded in zip(self.buckets, self.folded, strict=True):
            if folded:
                bs.residual.zero_()
            bs.residual_live = into_residual or (bs.residual_live and not folded)

    def grads_written_after_launch(self) -> bool:
        """Whether a gradient buffer was written after its launch: ``param.grad`` changed in place (by gradient
        clipping of ``param.grad``, say) after it was sent, which cannot change this step."""
        return any(bs.grads._version != v for bs, v in zip(self.buckets, self.sent_versions, strict=True))

    def _launch(self, i: int) -> Pending:
        """Bucket ``i``'s collective: the dense gradient in warm-up, else the compact values at the mask."""
        bs = self.buckets[i]
        bs.adopt_grads()
        if self.loss_scale is not None and self.loss_scale != 1.0:
            bs.grads.mul_(1.0 / self.loss_scale)
        if self.skip_nonfinite:
            self.nonfinite |= ~torch.isfinite(bs.grads).all()
        self.sent_versions[i] = bs.grads._version  # no collective writes grads: a later change is the user's
        self.wire.count_dense_equivalent(bs.layout.numel, bs.layout.dtype.itemsize)
        return self._launch_dense(i, bs) if self.dense else self._launch_sparse(i, bs)

    def _launch_dense(self, i: int, bs: BucketState) -> Pending:
        """The whole gradient, summed into :meth:`~BucketState.dense_synced` (never into ``grads`` itself)."""
        if self.config.wire_format == "int8":
            # Error feedback on every coordinate: e + g goes out rounded, and what the codes did not carry becomes
            # the residual, at once or, when the step may still be skipped, at commit_staged.
            a = bs.residual + bs.grads if self.skip_nonfinite else bs.residual.add_(bs.grads)
            self.staged[i] = a if self.skip_nonfinite else None
            return self.wire.reduce_scatter_int8("dense", bs.dense_synced(), a, bs.dense_int8_group)
        if bs.sharded:
            return self.wire.reduce_scatter_sum("dense", bs.dense_synced(), self._dense_source(i, bs))
        # The residual's storage: a replicated bucket never turns dense after sparse steps, and one in DDP's dense
        # form took it only once it was empty (BucketState.replicate).
        total = bs.dense_synced()
        total.copy_(bs.grads)
        return self.wire.all_reduce_sum("dense", total)

    def _dense_source(self, i: int, bs: BucketState) -> Tensor:
        """What a sharded fp32 dense step sends: the gradient, with the residual a sparse or int8 form left (then
        zeroed when the step is applied; a step that may still be skipped sends a copy)."""
        if not bs.residual_live:
            return bs.grads
        self.folded[i] = True
        return bs.residual + bs.grads if self.skip_nonfinite else bs.residual.add_(bs.grads)

    def _launch_sparse(self, i: int, bs: BucketState) -> Pending:
        """The compact values at the mask; a later round keeps the first round's mask (``mask_delay=0`` builds
        it from the first round's gradient)."""
        mask = self.masks.for_launch(i, self.step) if self.rounds == 1 else self.masks.in_use(i)
        bs.k = mask.shape[1]  # the density ramp: a mask carries the slots per chunk of its step
        if self.skip_nonfinite:
            feedback.stage(bs, mask)  # the residual takes the gradient once every rank agreed on the step
        else:
            feedback.compact(bs, mask)
        if self.config.wire_format == "int8":
            pending = self.wire.reduce_scatter_int8("values", bs.sparse_synced(), bs.values, bs.k, bs.values_packets)
            if not self.skip_nonfinite:  # else feedback.commit takes the rounding error back
                feedback.keep_rounding_error(bs, mask)
            return pending
        if bs.sharded:
            return self.wire.reduce_scatter_sum("values", bs.sparse_synced(), bs.values)
        return self.wire.all_reduce_sum("values", bs.values)

    # ------------------------------------------------------------------ synchronised gradients

    def synced_grads(self) -> list[Tensor]:
        """Per bucket, this step's averaged gradient; waits for the value collectives, in order, once."""
        if self._synced is None:
            w = self.wire.world_size
            synced = []
            for i, bs in enumerate(self.buckets):
                g = bs.dense_synced() if self.dense else bs.sparse_synced()
                pending = self.pending[i]
                assert pending is not None
                self.wire.wait(pending)
                self.pending[i] = None
                if w > 1:
                    g.div_(w)
                carry = self.carry[i]
                if carry is not None:
                    g.add_(carry)
                synced.append(g)
            self._synced = synced
        return self._synced

    def squared_norm(self) -> Tensor:
        """Global squared L2 norm of the synced gradients (sharded: summed over ranks, one scalar all-reduce)."""
        if self._squared_norm is None:
            squares = [g.float().square().sum() for g in self.synced_grads()]
            # Widened to fp64 together (exactly, as each alone would be), then summed in fp64.
            sq = torch.stack(squares).to(torch.float64).sum().reshape(1)
            if self.buckets[0].sharded and self.wire.world_size > 1:  # every bucket is in the same mode
                sq32 = sq.to(torch.float32)
                self.wire.wait(self.wire.all_reduce_sum("scalars", sq32))
                sq = sq32.to(torch.float64)
            self._squared_norm = sq
        return self._squared_norm

    def any_nonfinite(self) -> bool:
        """Whether any rank saw a non-finite value this step (one scalar all-reduce, so all ranks agree)."""
        flag = self.nonfinite.clone()
        for g in self.synced_grads():
            flag |= ~torch.isfinite(g).all()
        f = flag.to(torch.float32).reshape(1)
        if self.wire.world_size > 1:
            self.wire.wait(self.wire.all_reduce_sum("scalars", f))
        return bool(f.item() > 0)

    def wait_all(self) -> None:
        """Wait for every value collective still in flight (closing the engine)."""
        for pending in self.pending:
            if pending is not None:
                pending.wait()
