"""The SCAPE engine: gradient synchronisation and AdamS stepping for one data-parallel group.

This is the one place where the algorithm lives (``docs/algorithm.md`` restates it). The Lightning
strategies, the simulation and the benchmarks only drive it:

    engine = ScapeEngine(AdamS(model.parameters()), ScapeConfig(density=0.01), communicator)
    for batch in data:
        loss = model(batch); loss.backward()   # bucket collectives launch from grad hooks
        engine.step()                          # wait, AdamS on the mask, gather, next mask
        engine.zero_grad()

Order of communication inside a step (modded-nanogpt style: launch first, wait in order, gather last):
backward hooks launch each bucket's value collective as soon as its gradients are complete (after
waiting for that bucket's delayed mask, whose all-gather overlapped the forward pass); ``step`` waits
for them in order, runs AdamS on the masked slots, launches every parameter all-gather, builds the next
masks and launches their all-gathers, then waits for the parameter gathers and scatters them.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_scape import kernels
from lightning_scape.adams import state_dtype_for
from lightning_scape.comm import (
    KIND_DENSE,
    KIND_INDICES,
    KIND_PARAMS,
    KIND_SCALARS,
    KIND_SETUP,
    KIND_VALUES,
    ByteCounters,
    Communicator,
    Pending,
    SoloCommunicator,
)
from lightning_scape.config import ScapeConfig
from lightning_scape.layout import Bucket, build_buckets

log = logging.getLogger(__name__)

_STATE_VERSION = 1


@dataclass
class Mask:
    """One mask of a bucket: ``[world_size * chunks_per_shard, k]`` int16 chunk-local indices.

    Row ``r * chunks_per_shard + c`` is chunk c of rank r's shard. ``pending`` is the all-gather that
    is still filling ``indices`` (None once complete); ``built_at`` is the step after which it was built.
    """

    indices: Tensor
    built_at: int
    pending: Pending | None = None


class _BucketState:
    """Tensors of one bucket (views into them are the model's parameters and gradients)."""

    def __init__(self, layout: Bucket, cfg: ScapeConfig, rank: int) -> None:
        self.layout = layout
        dev, dt = layout.device, layout.dtype
        sdt = state_dtype_for(dt)
        P, S = layout.padded_numel, layout.shard_numel
        self.params = torch.zeros(P, dtype=dt, device=dev)
        self.grads = torch.zeros(P, dtype=dt, device=dev)
        self.residual = torch.zeros(P, dtype=sdt, device=dev)
        # The region this rank updates: its shard (sharded) or the whole bucket (replicated).
        self.region_start = rank * S if cfg.sharded else 0
        self.region_numel = S if cfg.sharded else P
        self.momentum = torch.zeros(self.region_numel, dtype=sdt, device=dev)
        self.last_sent = torch.zeros(self.region_numel, dtype=torch.int32, device=dev)
        k = cfg.slots_per_chunk
        self.slots = layout.chunks * k  # all ranks' slots (d N of this bucket)
        self.region_slots = self.region_numel // layout.chunk_size * k
        self.values = torch.zeros(self.slots, dtype=dt, device=dev)  # compact send buffer (v)
        # Sharded: averaged values of the owned slots; replicated: all-reduced in place in `values`.
        self.gbar = torch.zeros(self.region_slots, dtype=dt, device=dev) if cfg.sharded else self.values
        self.new_values = torch.zeros(self.region_slots, dtype=dt, device=dev)
        self.gathered = torch.zeros(self.slots, dtype=dt, device=dev) if cfg.sharded else self.new_values
        self.dense_shard: Tensor | None = None  # warm-up reduce-scatter output (sharded), freed after
        self.masks: deque[Mask] = deque()
        self.last_built: Mask | None = None
        self.pending: Pending | None = None
        self.ready = 0
        self.launched = False

    @property
    def region_params(self) -> Tensor:
        return self.params[self.region_start : self.region_start + self.region_numel]

    @property
    def region_residual(self) -> Tensor:
        return self.residual[self.region_start : self.region_start + self.region_numel]

    def owned(self, full_or_region: Tensor, sharded: bool, rank: int) -> Tensor:
        """The part of a region-sized tensor that lies in this rank's shard (mask generation)."""
        if sharded:
            return full_or_region
        S = self.layout.shard_numel
        return full_or_region[rank * S : (rank + 1) * S]

    def region_rows(self, mask: Tensor, sharded: bool, rank: int) -> Tensor:
        if not sharded:
            return mask
        n = self.layout.chunks_per_shard
        return mask[rank * n : (rank + 1) * n]


class ScapeEngine:
    """SCAPE for the trainable parameters of one optimizer on one data-parallel group.

    On construction the engine flattens the parameters into buckets: every trainable parameter becomes
    a view into its bucket's flat buffer (so its storage moves; call this before ``torch.compile`` and
    after moving the model to its device), and its ``.grad`` becomes a view into the bucket's gradient
    buffer. Frozen parameters (``requires_grad=False``) are left alone; tied parameters count once.

    Args:
        optimizer: An :class:`~lightning_scape.AdamS` (or any optimizer whose param groups carry
            ``lr``, ``betas``, ``eps``, ``weight_decay`` and optionally ``bias_correction``). Its param
            groups stay the source of the hyperparameters, so LR schedulers keep working; its own
            ``step`` must not be called.
        config: The SCAPE configuration.
        communicator: The group's collectives; default: world size 1.
        param_order: The model's parameters in registration order, to predict when gradients arrive.
        sync_params: Give every rank rank 0's parameters at construction (one all-reduce of the flat
            buffers, counted as ``setup`` traffic), as DDP's constructor does, so replicas that were
            initialised differently cannot diverge silently. Pass False only when the caller has already
            synchronised the model (the Lightning strategies broadcast parameters and buffers at set-up).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        config: ScapeConfig | None = None,
        communicator: Communicator | None = None,
        param_order: list[torch.nn.Parameter] | None = None,
        sync_params: bool = True,
    ) -> None:
        self.optimizer = optimizer
        self.config = config or ScapeConfig()
        self.comm: Communicator = communicator or SoloCommunicator()
        self.rank = self.comm.rank
        self.world_size = self.comm.world_size
        cfg = self.config
        for g in optimizer.param_groups:
            missing = [k for k in ("lr", "betas", "eps", "weight_decay") if k not in g]
            if missing:
                raise ValueError(
                    f"ScapeEngine needs AdamS-style param groups; this one lacks {missing}. "
                    "Build the optimizer as lightning_scape.AdamS(params, ...)."
                )
        layouts = build_buckets(
            optimizer.param_groups, self.world_size, cfg.chunk_size, cfg.bucket_cap_mb, param_order
        )
        if not layouts:
            raise ValueError("ScapeEngine got no trainable parameters (all frozen or none given).")
        self.buckets = [_BucketState(b, cfg, self.rank) for b in layouts]
        self._bucket_of: dict[int, _BucketState] = {}
        self._hooks: list[Any] = []
        for bs in self.buckets:
            for place in bs.layout.places:
                p = place.param
                view = bs.params[place.offset : place.offset + place.numel]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
                gview = bs.grads[place.offset : place.offset + place.numel].view_as(p)
                if p.grad is not None:
                    gview.copy_(p.grad)
                p.grad = gview
                self._bucket_of[id(p)] = bs
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        self.numel = sum(b.layout.numel for b in self.buckets)
        self.counters = ByteCounters(world_size=self.world_size)
        self._sync_initial_params(sync_params)
        self.padded_numel = sum(b.layout.padded_numel for b in self.buckets)
        self.step_count = 0
        self.refresh_count = 0
        self.require_backward_grad_sync = True
        self.last_grad_norm: float | None = None
        # Set by the Lightning strategies (lightning_scape/_wiring.py) for fp16 loss scaling (GradScaler):
        # ``grad_scale`` is the loss scale the incoming gradients carry (divided out before they touch the
        # residual); ``check_finite`` makes every rank skip a step in which any rank saw a non-finite value.
        self.grad_scale: float | None = None
        self.check_finite = False
        self.last_step_skipped = False
        self.last_used_masks: list[Tensor] | None = None  # per bucket, the mask of the last sparse step
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=self.buckets[0].params.device)
        self._synced = False  # this step's value collectives were waited on and averaged
        self._step_sq_norm: Tensor | None = None  # this step's global squared norm, once computed
        self._next_launch = 0
        self._step_open = False
        if cfg.dense_warmup_steps == 0 and cfg.mask_delay > 0:
            self._refresh_masks(new=True)

    @torch.no_grad()
    def _sync_initial_params(self, enabled: bool) -> None:
        """Rank 0's parameters everywhere: the others contribute zeros to one all-reduce (exact)."""
        if not enabled or self.world_size == 1:
            return
        pending = []
        for bs in self.buckets:
            if self.rank != 0:
                bs.params.zero_()
            pending.append(self.comm.all_reduce_sum(bs.params))
            self.counters.count_all_reduce(KIND_SETUP, bs.layout.padded_numel, bs.layout.dtype.itemsize)
        for p in pending:
            self.counters.timed_wait(p)

    # ------------------------------------------------------------------ public API

    @property
    def in_warmup(self) -> bool:
        """Whether the next step is a dense warm-up step."""
        return self.step_count < self.config.dense_warmup_steps

    @property
    def slots(self) -> int:
        """d N: mask slots over all ranks and buckets (the values sent per sparse step, before the ring)."""
        return sum(b.slots for b in self.buckets)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally and send nothing."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero the gradient buffers (the parameters' ``.grad`` stay views into them)."""
        for bs in self.buckets:
            bs.grads.zero_()
            for place in bs.layout.places:
                p = place.param
                if p.grad is None or p.grad.data_ptr() != bs.grads[place.offset :].data_ptr():
                    p.grad = bs.grads[place.offset : place.offset + place.numel].view_as(p)

    @torch.no_grad()
    def step(self, max_grad_norm: float | None = None, clip_value: float | None = None) -> None:
        """Finish synchronising this step's gradients and update the parameters.

        Args:
            max_grad_norm: Clip the global norm of the synchronised gradient (the averaged compact
                values in sparse steps) to this value.
            clip_value: Clamp every synchronised gradient value to ``[-clip_value, clip_value]``.
        """
        self._open_step()
        self._launch_in_order(all_buckets=True)
        t = self.step_count + 1
        if self.in_warmup:
            applied = self._dense_step(t, max_grad_norm, clip_value)
        else:
            applied = self._sparse_step(t, max_grad_norm, clip_value)
        self.last_step_skipped = not applied
        if applied:
            self.step_count = t
            self.counters.steps = t
        self._next_launch = 0
        for bs in self.buckets:
            bs.launched = False
            bs.ready = 0
        self._step_open = False
        self._synced = False
        self._step_sq_norm = None
        self._nonfinite.zero_()

    @torch.no_grad()
    def global_grad_norm(self) -> float:
        """Global L2 norm of this step's synchronised gradient, before clipping (call after backward).

        Finishes the step's synchronisation early (:meth:`step` then does not wait again). In sharded mode
        it costs the scalar all-reduce that norm clipping uses, shared with it.
        """
        self._open_step()
        self._launch_in_order(all_buckets=True)
        norm = self._squared_norm(self._synced_grads(), reduce=self.config.sharded).sqrt()
        self.last_grad_norm = float(norm.item())
        return self.last_grad_norm

    def close(self, wait: bool = True) -> None:
        """Remove the gradient hooks and wait for collectives still in flight.

        Args:
            wait: False after a failed collective: drop what is in flight instead of waiting for it.
        """
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if not wait:
            return
        for bs in self.buckets:
            for m in bs.masks:
                self._wait_mask(m)
            if bs.pending is not None:
                bs.pending.wait()
                bs.pending = None

    def current_masks(self) -> list[Tensor]:
        """Per bucket, the mask the next sparse step will use (waits for its all-gather)."""
        out = []
        for bs in self.buckets:
            if not bs.masks:
                raise RuntimeError("No mask is queued yet: the engine is still in dense warm-up.")
            self._wait_mask(bs.masks[0])
            out.append(bs.masks[0].indices)
        return out

    def last_built_masks(self) -> list[Tensor]:
        """Per bucket, the most recently built mask (waits for its all-gather)."""
        out = []
        for bs in self.buckets:
            if bs.last_built is None:
                raise RuntimeError("No mask has been built yet: the engine is still in dense warm-up.")
            self._wait_mask(bs.last_built)
            out.append(bs.last_built.indices)
        return out

    def oldest_unsent_age(self) -> int:
        """Steps since the least recently sent coordinate of this rank's region was last sent."""
        if self.in_warmup:
            return 0
        return max(int(self.step_count - bs.last_sent.min().item()) for bs in self.buckets)

    def residual_norm(self) -> float:
        """L2 norm of this rank's error-feedback residual."""
        return float(torch.stack([bs.residual.float().norm() for bs in self.buckets]).norm())

    # ------------------------------------------------------------------ backward hooks

    def _on_grad_ready(self, p: Tensor) -> None:
        if not self.require_backward_grad_sync:
            return
        with torch.no_grad():
            bs = self._bucket_of[id(p)]
            if bs.launched:
                raise RuntimeError(
                    "SCAPE: a gradient arrived for a bucket that was already synchronised this step "
                    "(two backward passes without an optimizer step?). Wrap all but the last backward "
                    "of a step in engine.no_sync() / Fabric's no_backward_sync."
                )
            self._open_step()
            bs.ready += 1
            if bs.ready == len(bs.layout.places):
                self._launch_in_order(all_buckets=False)

    def _open_step(self) -> None:
        if not self._step_open:
            self._step_open = True
            self.counters.start_step()

    def _launch_in_order(self, all_buckets: bool) -> None:
        """Launch ready buckets strictly in index order, so every rank issues the same sequence."""
        while self._next_launch < len(self.buckets):
            bs = self.buckets[self._next_launch]
            if not all_buckets and bs.ready < len(bs.layout.places):
                return
            self._launch(bs)
            self._next_launch += 1

    def _adopt_grads(self, bs: _BucketState) -> None:
        """Make every parameter's ``.grad`` the bucket's view (copying a gradient autograd replaced)."""
        for place in bs.layout.places:
            p = place.param
            view = bs.grads[place.offset : place.offset + place.numel]
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

    def _launch(self, bs: _BucketState) -> None:
        self._adopt_grads(bs)
        if self.grad_scale is not None and self.grad_scale != 1.0:
            bs.grads.mul_(1.0 / self.grad_scale)
        if self.check_finite:
            self._nonfinite |= ~torch.isfinite(bs.grads).all()
        cfg, c = self.config, self.counters
        item = bs.layout.dtype.itemsize
        if self.in_warmup:
            if cfg.sharded:
                if bs.dense_shard is None:
                    bs.dense_shard = torch.empty(
                        bs.layout.shard_numel, dtype=bs.layout.dtype, device=bs.grads.device
                    )
                bs.pending = self.comm.reduce_scatter_sum(bs.dense_shard, bs.grads)
                c.count_reduce_scatter(KIND_DENSE, bs.layout.padded_numel, item)
            else:
                bs.pending = self.comm.all_reduce_sum(bs.grads)
                c.count_all_reduce(KIND_DENSE, bs.layout.padded_numel, item)
        else:
            t = self.step_count + 1
            if cfg.mask_delay == 0:
                self._build_mask_from_current_gradient(bs, t)
            mask = bs.masks[0]
            self._wait_mask(mask)
            if self.check_finite:
                self._compact_deferred(bs, mask.indices)
            else:
                kernels.ef_compact(bs.residual, bs.grads, mask.indices, bs.layout.chunk_size, bs.values)
            if cfg.sharded:
                bs.pending = self.comm.reduce_scatter_sum(bs.gbar, bs.values)
                c.count_reduce_scatter(KIND_VALUES, bs.slots, item)
            else:
                bs.pending = self.comm.all_reduce_sum(bs.values)
                c.count_all_reduce(KIND_VALUES, bs.slots, item)
        c.count_dense_equivalent(bs.layout.numel, item)
        bs.launched = True

    # ------------------------------------------------------------------ the step

    def _group(self, bs: _BucketState) -> dict[str, Any]:
        return self.optimizer.param_groups[bs.layout.group_index]

    def _synced_grads(self) -> list[Tensor]:
        """Per bucket, this step's averaged gradient: waits for the value collectives once per step."""
        cfg, w = self.config, self.world_size
        out: list[Tensor] = []
        for bs in self.buckets:
            g = (bs.dense_shard if cfg.sharded else bs.grads) if self.in_warmup else bs.gbar
            assert g is not None
            if not self._synced:
                assert bs.pending is not None
                self.counters.timed_wait(bs.pending)
                bs.pending = None
                if w > 1:
                    g.div_(w)
            out.append(g)
        self._synced = True
        return out

    def _squared_norm(self, grads: list[Tensor], reduce: bool) -> Tensor:
        """Global squared L2 norm of ``grads`` (``reduce``: sum over ranks first), once per step."""
        if self._step_sq_norm is None:
            squares = [g.float().square().sum() for g in grads]
            sq = torch.stack([s.to(torch.float64) for s in squares]).sum().reshape(1)
            if reduce and self.world_size > 1:
                sq32 = sq.to(torch.float32)
                self.counters.timed_wait(self.comm.all_reduce_sum(sq32))
                self.counters.count_all_reduce(KIND_SCALARS, 1, 4)
                sq = sq32.to(torch.float64)
            self._step_sq_norm = sq
        return self._step_sq_norm

    def _clip_coef(self, grads: list[Tensor], max_grad_norm: float | None, reduce: bool) -> Tensor | None:
        """Global-norm clipping coefficient (``reduce``: sum the squares over ranks first)."""
        if max_grad_norm is None or not grads:
            return None
        norm = self._squared_norm(grads, reduce).sqrt()
        self.last_grad_norm = float(norm.item())
        return (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)

    def _any_nonfinite(self, received: list[Tensor]) -> bool:
        """Whether any rank saw a non-finite value this step (one scalar all-reduce, so all ranks agree)."""
        flag = self._nonfinite.clone()
        for g in received:
            flag |= ~torch.isfinite(g).all()
        f = flag.to(torch.float32).reshape(1)
        if self.world_size > 1:
            self.counters.timed_wait(self.comm.all_reduce_sum(f))
            self.counters.count_all_reduce(KIND_SCALARS, 1, 4)
        return bool(f.item() > 0)

    def _compact_deferred(self, bs: _BucketState, mask: Tensor) -> None:
        """``ef_compact`` without writing the residual: ``v = (e + g)[mask]``, bitwise the same values.

        With ``check_finite`` the residual takes the gradient only in :meth:`_finish_deferred_ef`, once every
        rank agreed that the step is finite, so a skipped step leaves it untouched.
        """
        pos = kernels.mask_positions(mask, bs.layout.chunk_size)
        bs.values.copy_(bs.residual.index_select(0, pos).add_(bs.grads.index_select(0, pos)))

    def _finish_deferred_ef(self, bs: _BucketState, mask: Tensor) -> None:
        """The residual half of ``ef_compact``: ``e = e + g``, then the sent slots keep their rounding error."""
        pos = kernels.mask_positions(mask, bs.layout.chunk_size)
        bs.residual.add_(bs.grads)
        picked = bs.residual.index_select(0, pos)
        sent = picked.to(bs.values.dtype).to(bs.residual.dtype)
        bs.residual.index_copy_(0, pos, picked.sub_(sent))

    def _dense_step(self, t: int, max_grad_norm: float | None, clip_value: float | None) -> bool:
        """One dense warm-up step; False when it was skipped (``check_finite``)."""
        cfg = self.config
        grads = self._synced_grads()
        if self.check_finite and self._any_nonfinite(grads):
            return False
        coef = self._clip_coef(grads, max_grad_norm, reduce=cfg.sharded)
        gathers: list[tuple[_BucketState, Pending]] = []
        for bs, g in zip(self.buckets, grads, strict=True):
            if coef is not None:
                g.mul_(coef.to(g.dtype))
            if clip_value is not None:
                g.clamp_(-clip_value, clip_value)
            group = self._group(bs)
            b1, b2 = group["betas"]
            kernels.dense_adams(
                bs.region_params,
                bs.momentum,
                g,
                step=t,
                lr=group["lr"],
                beta1=b1,
                beta2=b2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                bias_correction=group.get("bias_correction", True),
            )
            if cfg.sharded:
                # The gradient shard is consumed: reuse it as the all-gather's send buffer.
                send = bs.dense_shard
                assert send is not None
                send.copy_(bs.region_params)
                gathers.append((bs, self.comm.all_gather(bs.params, send)))
                self.counters.count_all_gather(KIND_DENSE, bs.layout.shard_numel, bs.layout.dtype.itemsize)
        for _bs, pending in gathers:
            self.counters.timed_wait(pending)
        if t == cfg.dense_warmup_steps:
            for bs in self.buckets:
                bs.dense_shard = None
                bs.last_sent.fill_(t)
            if cfg.mask_delay > 0:
                self._refresh_masks(new=True)
        return True

    def _sparse_step(self, t: int, max_grad_norm: float | None, clip_value: float | None) -> bool:
        """One sparse step; False when it was skipped (``check_finite``)."""
        cfg = self.config
        gbars = self._synced_grads()
        if self.check_finite:
            if self._any_nonfinite(gbars):
                return False
            for bs in self.buckets:
                self._finish_deferred_ef(bs, self._used_mask(bs).indices)
        self.last_used_masks = [self._used_mask(bs).indices for bs in self.buckets]
        coef = self._clip_coef(gbars, max_grad_norm, reduce=cfg.sharded)
        gathers: list[tuple[_BucketState, Pending]] = []
        for bs in self.buckets:
            if coef is not None:
                bs.gbar.mul_(coef.to(bs.gbar.dtype))
            if clip_value is not None:
                bs.gbar.clamp_(-clip_value, clip_value)
            self._update_region(bs, t)
            if cfg.sharded:
                pending = self.comm.all_gather(bs.gathered, bs.new_values)
                self.counters.count_all_gather(KIND_PARAMS, bs.region_slots, bs.layout.dtype.itemsize)
                gathers.append((bs, pending))
        # Every parameter gather is in flight: build the next masks under them.
        since_warmup = t - cfg.dense_warmup_steps
        self._refresh_masks(new=since_warmup % cfg.mask_refresh_interval == 0)
        for bs, pending in gathers:
            self.counters.timed_wait(pending)
            group = self._group(bs)
            decay = 1.0 - group["lr"] * group["weight_decay"]
            kernels.scatter_decay(
                bs.params, bs.gathered, self._used_mask(bs).indices, bs.layout.chunk_size, decay
            )
        for bs in self.buckets:
            bs.masks.popleft()
        return True

    def _used_mask(self, bs: _BucketState) -> Mask:
        return bs.masks[0]

    def _update_region(self, bs: _BucketState, t: int) -> None:
        """AdamS on the masked slots of this rank's region; replicated mode also applies it to the replica."""
        cfg = self.config
        group = self._group(bs)
        b1, b2 = group["betas"]
        lr = group["lr"]
        hyper = dict(
            step=t,
            lr=lr,
            beta1=b1,
            beta2=b2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            bias_correction=group.get("bias_correction", True),
        )
        mask = self._used_mask(bs).indices
        rows = bs.region_rows(mask, cfg.sharded, self.rank)
        C = bs.layout.chunk_size
        kernels.sparse_adams(
            bs.region_params,
            bs.momentum,
            bs.last_sent,
            bs.gbar,
            rows,
            C,
            bs.new_values,
            lr_update=lr * cfg.sparse_lr_scale,
            staleness_correction=cfg.staleness_correction,
            catch_up=cfg.catch_up,
            catch_up_cap=cfg.catch_up_cap,
            **hyper,
        )
        if cfg.sharded:
            return
        decay = 1.0 - lr * group["weight_decay"]
        if cfg.unmasked_update == "frozen":
            kernels.scatter_decay(bs.params, bs.new_values, rows, C, decay)
            return
        # unmasked_update == "momentum": every coordinate takes the AdamS step with g = 0, except the
        # masked ones, which keep the update computed above from the averaged values.
        pos = kernels.mask_positions(rows, C)
        m_slots = bs.momentum.index_select(0, pos)
        kernels.dense_adams(bs.params, bs.momentum, None, lr_update=lr * cfg.sparse_lr_scale, **hyper)
        bs.momentum.index_copy_(0, pos, m_slots)
        kernels.scatter_decay(bs.params, bs.new_values, rows, C, 1.0)

    # ------------------------------------------------------------------ masks

    def _wait_mask(self, mask: Mask) -> None:
        if mask.pending is not None:
            self.counters.timed_wait(mask.pending)
            mask.pending = None

    def _mask_is_local(self) -> bool:
        """Whether every rank can compute every mask from identical state (no index traffic)."""
        cfg = self.config
        return cfg.mask_statistic == "random" or (not cfg.sharded and cfg.mask_statistic == "momentum")

    def _refresh_masks(self, new: bool) -> None:
        """Queue the mask for step ``step_count + mask_delay`` (+1 when called from inside a step)."""
        cfg = self.config
        if cfg.mask_delay == 0:
            return
        for bs in self.buckets:
            # Called from inside a step the queue still holds the mask in use, popped after the step.
            target = cfg.mask_delay + (1 if bs.masks else 0)
            if new or bs.last_built is None:
                bs.last_built = self._build_mask(
                    bs,
                    bs.owned(bs.momentum, cfg.sharded, self.rank),
                    bs.owned(bs.region_residual, cfg.sharded, self.rank),
                )
            while len(bs.masks) < target:
                bs.masks.append(bs.last_built)
        if new:
            self.refresh_count += 1

    def _build_mask_from_current_gradient(self, bs: _BucketState, t: int) -> None:
        """``mask_delay=0``: score ``e + g`` of this step and wait for the mask before sending."""
        cfg = self.config
        since_warmup = t - 1 - cfg.dense_warmup_steps
        if bs.last_built is None or since_warmup % cfg.mask_refresh_interval == 0:
            S = bs.layout.shard_numel
            own = slice(self.rank * S, (self.rank + 1) * S)
            a = bs.residual[own] + bs.grads[own]
            bs.last_built = self._build_mask(bs, bs.owned(bs.momentum, cfg.sharded, self.rank), a)
            if bs is self.buckets[-1]:
                self.refresh_count += 1
        bs.masks.clear()
        bs.masks.append(bs.last_built)

    def _build_mask(self, bs: _BucketState, momentum: Tensor, residual: Tensor) -> Mask:
        """Score this rank's shard (``momentum``, ``residual``), pick k slots per chunk, launch the gather."""
        cfg = self.config
        C, k, ke = bs.layout.chunk_size, cfg.slots_per_chunk, cfg.explore_slots_per_chunk
        offset = (self.refresh_count * ke) % C
        dev = bs.params.device
        t = self.step_count
        if cfg.mask_statistic == "random":
            gen = torch.Generator(device=dev)
            gen.manual_seed(hash((cfg.seed, bs.layout.index, self.refresh_count)) & 0x7FFF_FFFF_FFFF)
            scores = torch.rand(bs.layout.padded_numel, generator=gen, device=dev)
            return Mask(kernels.chunk_topk(scores, C, k, ke, offset), t)
        b1 = self._group(bs)["betas"][0]
        if self._mask_is_local():
            # Replicated momentum statistic: the full |m| is identical on every rank (the residual is
            # not), so every rank computes every shard's mask and nothing is sent.
            # select_mask's "gradient" statistic is |second argument|: here |m|.
            return Mask(kernels.select_mask(bs.momentum, bs.momentum, b1, "gradient", C, k, ke, offset), t)
        own = kernels.select_mask(momentum, residual, b1, cfg.mask_statistic, C, k, ke, offset)
        full = torch.empty(bs.layout.chunks, k, dtype=torch.int16, device=dev)
        pending = self.comm.all_gather(full.view(-1), own.view(-1))
        self.counters.count_all_gather(KIND_INDICES, own.numel(), 2)
        return Mask(full, t, pending)

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """This rank's SCAPE state: momentum region, residual, queued masks, counters and step.

        Parameters are not included (they are the model's). Every rank must save its own.
        """
        for bs in self.buckets:
            for m in bs.masks:
                self._wait_mask(m)
        return {
            "version": _STATE_VERSION,
            "config": self.config.to_dict(),
            "world_size": self.world_size,
            "rank": self.rank,
            "layout": [(b.layout.group_index, b.layout.numel, b.layout.padded_numel) for b in self.buckets],
            "step_count": self.step_count,
            "refresh_count": self.refresh_count,
            "counters": self.counters.state_dict(),
            "buckets": [
                {
                    "momentum": bs.momentum.clone(),
                    "residual": bs.residual.clone(),
                    "last_sent": bs.last_sent.clone(),
                    "masks": [(m.indices.clone(), m.built_at) for m in bs.masks],
                    "last_built": None
                    if bs.last_built is None
                    else (bs.last_built.indices.clone(), bs.last_built.built_at),
                }
                for bs in self.buckets
            ],
        }

    def check_state_dict(self, state: Any) -> None:
        """Raise ``ValueError`` unless :meth:`load_state_dict` can restore ``state`` exactly; changes nothing.

        Checks the format version, world size and rank, the configuration (``collective_timeout_s`` may
        differ), the bucket layout, and the shape and dtype of every saved tensor.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            found = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"SCAPE state has version {found!r}; this engine reads {_STATE_VERSION}.")
        if state["world_size"] != self.world_size or state["rank"] != self.rank:
            raise ValueError(
                f"SCAPE state was saved by rank {state['rank']} of {state['world_size']}, but this is rank "
                f"{self.rank} of {self.world_size}; resume on the same world size."
            )
        mine = self.config.to_dict()
        diff = {
            k: (state["config"].get(k), v)
            for k, v in mine.items()
            if k != "collective_timeout_s" and state["config"].get(k) != v
        }
        if diff:
            raise ValueError(
                f"SCAPE state comes from another configuration (field: (saved, current)): {diff}. Resume with "
                "the configuration the checkpoint was written with."
            )
        layout = [(b.layout.group_index, b.layout.numel, b.layout.padded_numel) for b in self.buckets]
        if [tuple(x) for x in state["layout"]] != layout or len(state["buckets"]) != len(self.buckets):
            raise ValueError(
                "SCAPE state has another bucket layout (model, param groups or bucket_cap_mb changed): "
                f"saved {[tuple(x) for x in state['layout']]}, current {layout}."
            )
        k = self.config.slots_per_chunk
        for i, (bs, saved) in enumerate(zip(self.buckets, state["buckets"], strict=True)):
            expect = {"momentum": bs.momentum, "residual": bs.residual, "last_sent": bs.last_sent}
            for name, t in expect.items():
                got = saved[name]
                if not isinstance(got, Tensor) or got.shape != t.shape or got.dtype != t.dtype:
                    desc = (got.dtype, tuple(got.shape)) if isinstance(got, Tensor) else type(got).__name__
                    raise ValueError(
                        f"SCAPE state: bucket {i} {name} is {desc}, expected {(t.dtype, tuple(t.shape))}."
                    )
            masks = list(saved["masks"]) + ([] if saved["last_built"] is None else [saved["last_built"]])
            for ix, _at in masks:
                if not isinstance(ix, Tensor) or ix.dtype != torch.int16 or tuple(ix.shape) != (bs.layout.chunks, k):
                    raise ValueError(
                        f"SCAPE state: bucket {i} has a mask that is not int16 of shape {(bs.layout.chunks, k)}."
                    )

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; refuses (changing nothing) a state that :meth:`check_state_dict` rejects."""
        self.check_state_dict(state)
        for bs, saved in zip(self.buckets, state["buckets"], strict=True):
            bs.momentum.copy_(saved["momentum"])
            bs.residual.copy_(saved["residual"])
            bs.last_sent.copy_(saved["last_sent"])
            dev = bs.params.device
            bs.masks = deque(Mask(ix.to(dev), at) for ix, at in saved["masks"])
            lb = saved["last_built"]
            bs.last_built = None if lb is None else Mask(lb[0].to(dev), lb[1])
        self.step_count = int(state["step_count"])
        self.refresh_count = int(state["refresh_count"])
        self.counters.load_state_dict(state["counters"])
