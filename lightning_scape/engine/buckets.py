"""A bucket's tensors: the flat buffers behind the model's parameters and gradients, and SCAPE's state.

Rank and mode are fixed when the bucket is built. Sharded mode: this rank updates its shard (the
*region* is the shard) and keeps momentum and last-sent steps only there. Replicated mode: every rank
updates the whole bucket (the region is the bucket). The residual always covers the whole bucket: every
rank keeps its own unsent gradient for every coordinate.

A sharded bucket can take DDP's dense form for a while (:meth:`BucketState.replicate`): every rank holds the
whole momentum, all-reduces the gradient during the backward pass and updates every parameter, so no parameter
all-gather follows the step. Checkpoints keep the shard (:meth:`BucketState.home`), as in sharded mode.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_scape.adams import state_dtype_for
from lightning_scape.comm.int8_packets import PacketCache
from lightning_scape.config import ScapeConfig, int8_dense_group
from lightning_scape.engine.layout import Bucket


class BucketState:
    """The tensors of one bucket on this rank.

    Attributes:
        layout: The bucket's geometry (:class:`~lightning_scape.engine.layout.Bucket`).
        params: ``[padded_numel]`` flat parameters; the model's parameters are views into it.
        grads: ``[padded_numel]`` flat gradients; the parameters' ``.grad`` are views into it.
        residual: ``[padded_numel]`` error-feedback residual e (state dtype): this rank's unsent gradient.
        momentum: ``[region_numel]`` AdamS first moment of the region (state dtype).
        last_sent: ``[region_numel]`` int32 step at which each coordinate of the region was last sent (in DDP's
            dense form, still the shard's).
        values: ``[slots]`` this rank's compact buffer of sent values. Replicated mode all-reduces it in
            place, so after the collective it holds the sums.
        received: ``[region_slots]`` sharded mode's reduce-scatter output: the sums of this rank's slots.
        updated: ``[region_slots]`` new parameter values at the region's slots.
        gathered: ``[slots]`` sharded mode's all-gather output: every owner's new values.
        dense_shard: Sharded warm-up's reduce-scatter output (this rank's shard of the summed gradient), also
            the parameter all-gather's send buffer; allocated at the first warm-up step, freed after the last.
        k: Slots per chunk of the step being taken (the density ramp changes it); the compact buffers are
            views of that size into buffers allocated once for the largest k of the run.
        first_step: The engine's step count when the bucket joined (0: from the start); AdamS's bias
            corrections count the bucket's steps from it, as Adam counts each parameter's.
        dense_replica: A sharded bucket in DDP's dense form (:meth:`replicate`): replicated until
            :meth:`unreplicate`.
        values_packets: The int8 wire's sparse reduce-scatter: its buffers, reused from step to step.
        params_packets: The int8 wire's sparse all-gather of changes: its buffers, reused from step to step.
    """

    def __init__(self, layout: Bucket, config: ScapeConfig, rank: int) -> None:
        self.layout = layout
        self.sharded = config.sharded
        dev, dt = layout.device, layout.dtype
        sdt = state_dtype_for(dt)
        P, S = layout.padded_numel, layout.shard_numel
        self.shard = slice(rank * S, (rank + 1) * S)
        self.region = self.shard if self.sharded else slice(0, P)
        region_numel = self.region.stop - self.region.start
        self.params = torch.zeros(P, dtype=dt, device=dev)
        self.grads = torch.zeros(P, dtype=dt, device=dev)
        self.residual = torch.zeros(P, dtype=sdt, device=dev)
        self.momentum = torch.zeros(region_numel, dtype=sdt, device=dev)
        self.last_sent = torch.zeros(region_numel, dtype=torch.int32, device=dev)
        self.k = config.slots_for(layout.chunk_size)
        cap = config.max_slots(layout.chunk_size)
        region_chunks = region_numel // layout.chunk_size
        self._values = torch.zeros(layout.chunks * cap, dtype=dt, device=dev)
        self._received = torch.zeros(region_chunks * cap, dtype=dt, device=dev) if self.sharded else None
        self._updated = torch.zeros(region_chunks * cap, dtype=dt, device=dev)
        self._gathered = torch.zeros(layout.chunks * cap, dtype=dt, device=dev) if self.sharded else None
        self.dense_shard: Tensor | None = None
        self.first_step = 0
        self.dense_replica = False
        self.int8_wire = config.wire_format == "int8"
        # Whether the residual may hold gradient not sent yet: sparse steps and the int8 wire leave it there, and
        # an fp32 dense step then sends it with its gradient (StepInFlight), so that no mass is lost.
        self.residual_live = False
        self.dense_int8_group = int8_dense_group(layout.shard_numel)  # int8 wire: coordinates per scale
        self.values_packets = PacketCache()
        self.params_packets = PacketCache()
        # mask_positions: the last mask asked for, its version and its positions; their buffer (for the largest k
        # of the run) and each chunk's first position ([chunks, 1]), allocated at the first call.
        self._positions: tuple[Tensor, int, Tensor] | None = None
        self._slot_cap = cap
        self._position_buffers: tuple[Tensor, Tensor] | None = None

    def replicate(self, momentum: Tensor) -> None:
        """Take DDP's dense form: ``momentum`` is the whole bucket's (every owner's shard, all-gathered), and the
        region becomes the bucket. Only between dense steps, with no unsent gradient in the residual (the dense
        steps of this form borrow its memory, as replicated mode's do)."""
        assert self.sharded and not self.residual_live, "replicate a sharded bucket whose residual is empty"
        self.momentum = momentum  # the last-sent steps stay the shard's: only sparse steps read them
        self.region = slice(0, self.layout.padded_numel)
        self.sharded, self.dense_replica, self.dense_shard = False, True, None

    def unreplicate(self) -> None:
        """Back from DDP's dense form to the shard: keep this rank's part of the momentum (no collective)."""
        if not self.dense_replica:
            return
        self.momentum = self.home(self.momentum).clone()
        self.region = self.shard
        self.sharded, self.dense_replica = True, False

    def home(self, momentum: Tensor) -> Tensor:
        """The momentum in the layout the bucket was built with (what checkpoints keep): the shard's part in DDP's
        dense form, else itself."""
        return momentum[self.shard] if self.dense_replica else momentum

    @property
    def slots(self) -> int:
        """All ranks' slots of this bucket at the current k (the bucket's d N)."""
        return self.layout.chunks * self.k

    @property
    def region_slots(self) -> int:
        """The slots of the region at the current k."""
        return (self.region.stop - self.region.start) // self.layout.chunk_size * self.k

    @property
    def values(self) -> Tensor:
        """``[slots]`` this rank's compact buffer (replicated mode: all-reduced in place)."""
        return self._values[: self.slots]

    @property
    def received(self) -> Tensor | None:
        """``[region_slots]`` sharded mode's reduce-scatter output."""
        return None if self._received is None else self._received[: self.region_slots]

    @property
    def updated(self) -> Tensor:
        """``[region_slots]`` new parameter values at the region's slots."""
        return self._updated[: self.region_slots]

    @property
    def gathered(self) -> Tensor | None:
        """``[slots]`` sharded mode's all-gather output."""
        return None if self._gathered is None else self._gathered[: self.slots]

    def bind_params(self) -> None:
        """Copy the parameters (and any gradients) into the flat buffers and make them views into them."""
        for place in self.layout.places:
            p = place.param
            view = self.params[place.offset : place.offset + place.numel]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
            grad_view = self.grads[place.offset : place.offset + place.numel].view_as(p)
            if p.grad is not None:
                grad_view.copy_(p.grad)
            p.grad = grad_view

    def adopt_grads(self) -> None:
        """Make every parameter's ``.grad`` the bucket's view (copying a gradient that autograd replaced)."""
        for place in self.layout.places:
            p = place.param
            view = self.grads[place.offset : place.offset + place.numel]
            g = p.grad
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr():
                if g.is_sparse:
                    raise RuntimeError("SCAPE does not support sparse gradients; use a dense embedding.")
                view.copy_(g.reshape(-1))
            else:
                continue
            p.grad = view.view_as(p)

    @property
    def region_params(self) -> Tensor:
        """The parameters this rank updates (a view)."""
        return self.params[self.region]

    @property
    def region_residual(self) -> Tensor:
        """The residual on the region (a view)."""
        return self.residual[self.region]

    def shard_of_region(self, region_tensor: Tensor) -> Tensor:
        """The part of a region-sized tensor that lies in this rank's shard (what mask generation scores)."""
        start = self.shard.start - self.region.start
        return region_tensor[start : start + self.layout.shard_numel]

    def region_rows(self, mask: Tensor) -> Tensor:
        """The rows of a whole-bucket mask that address the region's chunks."""
        C = self.layout.chunk_size
        return mask[self.region.start // C : self.region.stop // C]

    def mask_positions(self, mask: Tensor) -> Tensor:
        """:func:`~lightning_scape.kernels.mask_positions` of a whole-bucket mask, computed once per mask.

        A step reads its mask's positions more than once (the int8 wire: where the residual takes the rounding
        error back, where the change is taken from), so the last mask's are kept and returned again while it is
        the same tensor, unchanged (its version). One operation computes them, into a buffer kept for the largest
        k: a caller reads them before it asks for another mask's, which overwrite them.
        """
        kept = self._positions
        if kept is not None and kept[0] is mask and kept[1] == mask._version:
            return kept[2]
        rows, k = mask.shape
        buffers = self._position_buffers
        if buffers is None or buffers[0].numel() < rows * k:
            starts = torch.arange(rows, dtype=torch.int64, device=mask.device).mul_(self.layout.chunk_size)
            buffer = torch.empty(rows * max(k, self._slot_cap), dtype=torch.int64, device=mask.device)
            buffers = self._position_buffers = (buffer, starts.unsqueeze(1))
        buffer, starts = buffers
        positions = buffer[: rows * k]
        # i * chunk_size + mask[i, j], the int16 index widened exactly: what kernels.mask_positions computes.
        torch.add(mask, starts, out=positions.view(rows, k))
        self._positions = (mask, mask._version, positions)
        return positions

    def dense_synced(self) -> Tensor:
        """Where a dense step's summed gradient lands: the reduce-scatter output (sharded), else the residual's
        storage.

        Never ``grads`` itself, so ``param.grad`` keeps this rank's gradient. Replicated mode borrows the
        residual's memory instead of allocating a bucket-sized buffer: dense steps come before every sparse step
        and send every coordinate, so the residual is zero and unused there; :meth:`end_dense_step` zeroes it
        again.
        """
        layout = self.layout
        if self.sharded:
            if self.dense_shard is None:
                self.dense_shard = torch.empty(layout.shard_numel, dtype=layout.dtype, device=self.grads.device)
            return self.dense_shard
        if self.residual.dtype == layout.dtype:
            return self.residual
        # The residual's dtype is at least as wide as the parameters' (state_dtype_for): its bytes hold them.
        return self.residual.view(torch.uint8)[: layout.padded_numel * layout.dtype.itemsize].view(layout.dtype)

    def end_dense_step(self) -> None:
        """After a dense step: replicated mode zeroes the residual, whose storage held the summed gradient."""
        if not self.sharded:
            self.residual.zero_()

    def sparse_synced(self) -> Tensor:
        """Where a sparse step's summed values land: the reduce-scatter output (sharded), else in place."""
        received = self.received
        return received if received is not None else self.values

    def scatter_source(self) -> Tensor:
        """The new values every rank writes at the mask: all owners' (sharded), else this rank's own."""
        gathered = self.gathered
        return gathered if gathered is not None else self.updated


def zero_grads(buckets: list[BucketState]) -> None:
    """Zero every bucket's gradient buffer: one multi-tensor fill (a few launches on CUDA), not a launch per bucket.

    A parameter whose ``.grad`` a user set to None or replaced gets its view into the buffer back.
    """
    if buckets:
        torch._foreach_zero_([bs.grads for bs in buckets])
    for bs in buckets:
        for place in bs.layout.places:
            p = place.param
            if p.grad is None or p.grad.data_ptr() != bs.grads[place.offset :].data_ptr():
                p.grad = bs.grads[place.offset : place.offset + place.numel].view_as(p)
