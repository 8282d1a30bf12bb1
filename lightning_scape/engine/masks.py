"""The mask schedule: which mask each sparse step sends with, when masks are built, and their all-gathers.

A mask of a bucket is ``[W * chunks_per_shard, k]`` int16 chunk-local indices; row ``r * n_c + c`` is chunk c
of rank r's shard, and every rank holds the whole mask. Each rank builds the rows of its own shard from its
momentum and residual (partitioned generation) and all-gathers them; the gather stays in flight until the
step that uses the mask needs it.

Policy, with k = ``mask_delay``: every sparse step u has a new mask. With k = 1 it is built at the end of step
u - 1 (the first one at the end of the warm-up, or at construction without a warm-up) and queued; with k = 0 it
is built inside step u's backward pass from ``e + g`` and waited on at once. Every rank builds and gathers at
the same points, so every rank issues the same collectives.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_scape import kernels
from lightning_scape.comm import Pending, Wire
from lightning_scape.config import ScapeConfig
from lightning_scape.engine.buckets import BucketState


@dataclass
class Mask:
    """One bucket's mask; ``pending`` is the all-gather still filling ``indices`` (None once complete)."""

    indices: Tensor
    pending: Pending | None = None


class MaskSchedule:
    """The masks of every bucket: the queue of masks to use, the last one built, and the refresh counter.

    Args:
        buckets: The engine's buckets.
        config: The SCAPE configuration.
        wire: The group's collectives (the index all-gathers), counted.
        beta1_of: The b1 of a bucket's param group (the momentum statistic reads it at build time).

    ``statistic`` is what an owner scores: ``"momentum"``, ``|b1*m + (1-b1)*e|``. The benchmarks set it to
    ``"gradient"`` (``|e|``: raw-gradient top-k with error feedback) for the baseline SCAPE is compared with; it is
    not an option.
    """

    def __init__(
        self,
        buckets: list[BucketState],
        config: ScapeConfig,
        wire: Wire,
        beta1_of: Callable[[BucketState], float],
    ) -> None:
        self.buckets = buckets
        self.config = config
        self.wire = wire
        self.beta1_of = beta1_of
        self.queues: list[deque[Mask]] = [deque() for _ in buckets]
        self.last_built: list[Mask | None] = [None] * len(buckets)
        self.statistic = "momentum"
        self.refresh_count = 0  # completed refreshes (every bucket's mask built anew): places the exploration window
        self._built_in_refresh = 0

    @property
    def is_local(self) -> bool:
        """Whether every rank computes every mask from identical state (no index traffic): replicated momentum."""
        return self.config.masks_built_locally and self.statistic == "momentum"

    # ---------------------------------------------------------------------------- the schedule

    def begin(self, for_step: int | None = None) -> None:
        """The first masks (end of the dense warm-up, or construction without one), for step ``for_step`` (default:
        the first sparse step of the schedule)."""
        self._queue(for_step=self.config.dense_steps + 1 if for_step is None else for_step)

    def drop(self) -> None:
        """Wait for every mask's all-gather and drop them all (the engine's form turns dense)."""
        self.wait_all()
        self.queues = [deque() for _ in self.buckets]
        self.last_built = [None] * len(self.buckets)

    def restart(self, step: int) -> None:
        """Drop every mask and, past the warm-up, queue new ones for step ``step + 1`` as :meth:`begin` does.

        For a state re-sharded to another world size, whose masks had the old layout's owners: the new masks
        are built from the restored momentum and residual, so every rank must call this at the same point
        (the index all-gathers). They replace the last built masks: they take the same refresh index (the same
        exploration window), so from the same statistics they are the same masks, and the count is unchanged.
        With ``mask_delay=0`` the next backward pass builds them.
        """
        self.drop()
        if step >= self.config.dense_steps and self.config.mask_delay > 0:
            self.refresh_count = max(0, self.refresh_count - 1)
            self._queue(for_step=step + 1)

    def add_buckets(
        self, new: list[BucketState], step: int, kept: Mapping[int, tuple[list[Tensor], Tensor | None]] | None = None
    ) -> None:
        """Buckets that joined the engine after step ``step`` (already in ``buckets``), e.g. unfrozen parameters.

        During the warm-up nothing more: its end builds their first masks with the others'. After it, each gets
        a mask now, from its statistics (zero for new parameters: the exploration window, then the first chunks),
        queued like the others' (``mask_delay`` copies); it does not count as a refresh. A bucket in ``kept``
        (index: its saved queued masks and last built one) takes those instead. Every rank must call this at the
        same point (the index all-gathers).
        """
        kept = kept or {}
        for bs in new:
            self.queues.append(deque())
            self.last_built.append(None)
            if bs.layout.index in kept:
                self.keep(bs.layout.index, *kept[bs.layout.index])
        if step < self.config.dense_steps:
            return
        for bs in new:
            i = bs.layout.index
            if i in kept:
                continue
            self._build(i, bs.shard_of_region(bs.momentum), bs.residual[bs.shard], step + 1, count=False)
            built = self.last_built[i]
            assert built is not None
            self.queues[i].extend([built] * self.config.mask_delay)

    def keep(self, i: int, masks: list[Tensor], last_built: Tensor | None) -> None:
        """Bucket ``i``'s queued masks and last built one are these (saved) indices."""
        dev = self.buckets[i].params.device
        self.queues[i] = deque(Mask(ix.to(dev)) for ix in masks)
        self.last_built[i] = None if last_built is None else Mask(last_built.to(dev))

    def truncate(self, n: int) -> None:
        """Forget the masks of the buckets after the first ``n`` (their bucket left the engine)."""
        self.wait_all()
        del self.queues[n:]
        del self.last_built[n:]

    def after_sparse_step(self, step: int) -> None:
        """At the end of sparse step ``step``: queue the mask of the step ``mask_delay`` steps later."""
        self._queue(for_step=step + self.config.mask_delay)

    def for_launch(self, i: int, step: int) -> Tensor:
        """The mask bucket ``i`` sends with at sparse step ``step``, its all-gather waited on.

        With ``mask_delay=0`` it is built here, from this step's ``e + g``.
        """
        if self.config.mask_delay == 0:
            self._build_from_current_gradient(i, step)
        mask = self.queues[i][0]
        self.wait(mask)
        return mask.indices

    def in_use(self, i: int) -> Tensor:
        """The mask of bucket ``i`` that the sparse step being taken uses."""
        return self.queues[i][0].indices

    def finish_sparse_step(self) -> None:
        """Drop the masks the step used."""
        for queue in self.queues:
            queue.popleft()

    def wait(self, mask: Mask) -> None:
        """Wait for ``mask``'s all-gather, if it is still in flight."""
        if mask.pending is not None:
            self.wire.wait(mask.pending)
            mask.pending = None

    def next_masks(self) -> list[Tensor]:
        """Per bucket, the mask the next sparse step will use (waits for its all-gather)."""
        out = []
        for queue in self.queues:
            if not queue:
                raise RuntimeError("No mask is queued yet: the engine is still in dense warm-up.")
            self.wait(queue[0])
            out.append(queue[0].indices)
        return out

    def newest_masks(self) -> list[Tensor]:
        """Per bucket, the most recently built mask (waits for its all-gather)."""
        out = []
        for mask in self.last_built:
            if mask is None:
                raise RuntimeError("No mask has been built yet: the engine is still in dense warm-up.")
            self.wait(mask)
            out.append(mask.indices)
        return out

    def wait_all(self) -> None:
        """Wait for every queued mask's all-gather."""
        for queue in self.queues:
            for mask in queue:
                self.wait(mask)

    # ---------------------------------------------------------------------------- building

    def _queue(self, for_step: int) -> None:
        """Build each bucket's mask for step ``for_step`` (its slots per chunk) and queue it behind the one in use
        (``mask_delay=1``; with 0 the backward pass builds it)."""
        if self.config.mask_delay == 0:
            return
        for i, bs in enumerate(self.buckets):
            self._build(i, bs.shard_of_region(bs.momentum), bs.residual[bs.shard], for_step)
            built = self.last_built[i]
            assert built is not None
            self.queues[i].append(built)

    def _build_from_current_gradient(self, i: int, step: int) -> None:
        """``mask_delay=0``: score ``e + g`` of this step."""
        bs = self.buckets[i]
        self._build(i, bs.shard_of_region(bs.momentum), bs.residual[bs.shard] + bs.grads[bs.shard], step)
        queue = self.queues[i]
        queue.clear()
        built = self.last_built[i]
        assert built is not None
        queue.append(built)

    def _build(self, i: int, momentum: Tensor, residual: Tensor, for_step: int, count: bool = True) -> None:
        """Score this rank's shard of bucket ``i``, pick the slots of ``for_step`` and launch the index all-gather.

        ``count``: the build is part of a refresh (every bucket's mask built anew), which it completes last.
        """
        cfg, bs = self.config, self.buckets[i]
        C = bs.layout.chunk_size
        k = cfg.slots_at(for_step, C)
        ke = cfg.explore_slots(k)
        offset = (self.refresh_count * ke) % C
        dev = bs.params.device
        if self.is_local:
            # Replicated momentum statistic: the full |m| is identical on every rank (the residual is not),
            # so every rank computes every shard's mask and nothing is sent. select_mask's "gradient"
            # statistic is |second argument|: here |m|.
            mask = Mask(kernels.select_mask(bs.momentum, bs.momentum, self.beta1_of(bs), "gradient", C, k, ke, offset))
        else:
            own = kernels.select_mask(momentum, residual, self.beta1_of(bs), self.statistic, C, k, ke, offset)
            full = torch.empty(bs.layout.chunks, k, dtype=torch.int16, device=dev)
            mask = Mask(full, self.wire.all_gather("indices", full.view(-1), own.view(-1)))
        self.last_built[i] = mask
        if not count:
            return
        self._built_in_refresh += 1
        if self._built_in_refresh == len(self.buckets):
            self._built_in_refresh = 0
            self.refresh_count += 1
