"""The SCAPE engine: gradient synchronisation and AdamS stepping for one data-parallel group.

This is the one place where the algorithm lives (``docs/algorithm.md`` restates it). The Lightning
strategies, the simulation and the benchmarks only drive it:

    engine = ScapeEngine(AdamS(model.parameters()), ScapeConfig(density=0.01), communicator)
    for batch in data:
        loss = model(batch); loss.backward()   # bucket collectives launch from grad hooks
        engine.step()                          # wait, update the masked slots, gather, next mask
        engine.zero_grad()

The modules, one per mechanism: :mod:`~lightning_scape.engine.buckets` (each bucket's tensors),
:mod:`~lightning_scape.engine.step` (one step in flight: launches, waits, norm, finiteness),
:mod:`~lightning_scape.engine.feedback` (error feedback and compaction),
:mod:`~lightning_scape.engine.update` (the dense and interval updates and their hyperparameters),
:mod:`~lightning_scape.engine.masks` (the mask schedule) and :mod:`~lightning_scape.engine.state`
(checkpoints and re-sharding). This module holds the construction, the gradient hooks and
:meth:`ScapeEngine.step`, written as the step's communication schedule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_scape.comm import ByteCounters, Communicator, Pending, SoloCommunicator, Wire
from lightning_scape.config import ScapeConfig
from lightning_scape.engine import feedback, form_switch, joining, state, update
from lightning_scape.engine.buckets import BucketState, zero_grads
from lightning_scape.engine.layout import build_buckets
from lightning_scape.engine.masks import MaskSchedule
from lightning_scape.engine.step import StepInFlight
from lightning_scape.engine.waiting import WaitingBucket
from lightning_scape.kernels import AdamSHyper

__all__ = ["BucketState", "ScapeEngine"]


class ScapeEngine:
    """SCAPE for the trainable parameters of one optimizer on one data-parallel group.

    Every trainable parameter becomes a view into its bucket's flat buffer (build the engine after moving the model
    to its device, before ``torch.compile``), its ``.grad`` a view into the gradient buffer, holding this rank's
    gradient; frozen parameters join when unfrozen (:meth:`add_trainable_params`), tied ones count once. Backward
    passes before a step add up, as under DDP.

    Args:
        optimizer: An :class:`~lightning_scape.AdamS` (or param groups with ``lr``, ``betas``, ``eps``,
            ``weight_decay``); its param groups stay the source of the hyperparameters, so LR schedulers work.
            Its own ``step`` must not be called.
        config: The SCAPE configuration.
        communicator: The group's collectives; default: world size 1.
        param_order: The model's parameters in registration order, to predict when gradients arrive.
        sync_params: Give every rank rank 0's parameters at construction, as DDP does (one all-reduce, counted as
            ``setup`` traffic). Pass False only when the model is already synchronised (the strategies broadcast it).
        loss_scale: fp16: the scale the coming gradients carry (a ``GradScaler``'s ``get_scale``), divided out
            before the gradients touch the residual. None: the gradients are unscaled.
        skip_nonfinite: Skip, on every rank, a step in which any rank saw an inf/nan gradient (what fp16 loss
            scaling needs; one scalar all-reduce per step). :attr:`last_step_skipped` tells the ``GradScaler``.
        form_pilot: Chooses the form when ``config`` leaves it to SCAPE (``ScapeConfig.chooses_form``); default:
            the package's :class:`~lightning_scape.planning.pilot.FormPilot`. Ignored for a fixed form.
        resume_with_new_config: Let a load take a state saved with other settings but the same layout, carried into
            ``config`` (``docs/lightning.md``, "Changing SCAPE settings on resume"); False refuses it.

    ``requested_config`` is the configuration as given; ``config`` the form in use (what SCAPE chose, if it chooses).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        config: ScapeConfig | None = None,
        communicator: Communicator | None = None,
        param_order: list[torch.nn.Parameter] | None = None,
        sync_params: bool = True,
        loss_scale: Callable[[], float] | None = None,
        skip_nonfinite: bool = False,
        form_pilot: form_switch.Pilot | None = None,
        resume_with_new_config: bool = False,
    ) -> None:
        self.optimizer = optimizer
        self.resume_with_new_config = resume_with_new_config
        self.requested_config = config or ScapeConfig()
        self.config = cfg = self.requested_config.start_form()
        self.pilot = (form_pilot or form_switch.default_pilot()) if self.requested_config.chooses_form else None
        self.comm: Communicator = communicator or SoloCommunicator()
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.loss_scale, self.skip_nonfinite = loss_scale, skip_nonfinite
        _check_inputs(optimizer)
        self.param_order = param_order
        self.buckets: list[BucketState] = []  # none while every parameter is frozen (add_trainable_params)
        self._hooks: list[Any] = []
        self._bucket_index: dict[int, int] = {}
        self.numel = self.padded_numel = 0  # real and padded parameters of all buckets (joining.bind counts them)
        layouts = build_buckets(optimizer.param_groups, self.world_size, cfg.chunk_size, cfg.bucket_cap_mb, param_order)
        joining.bind(self, layouts)
        self.fixed_buckets = len(self.buckets)  # laid out at construction: a state that loads never moves these
        self.waiting: list[WaitingBucket] = []  # saved buckets whose parameters had not joined (engine/waiting.py)
        self.counters = ByteCounters(world_size=self.world_size)
        self.wire = Wire(self.comm, self.counters)
        self.sync_params = sync_params
        if sync_params:
            joining.sync_from_rank0(self, self.buckets)
        # The param groups are read when a mask is built: a scheduler or BaseFinetuning may have replaced them.
        self.masks = MaskSchedule(
            self.buckets, cfg, self.wire, lambda bs: optimizer.param_groups[bs.layout.group_index]["betas"][0]
        )
        self.step_count = 0
        # Per param group, the largest learning rate seen: catch_up_cap counts steps at it.
        self.peak_lr = [0.0] * len(optimizer.param_groups)
        self.require_backward_grad_sync = True
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False
        self.grads_written_after_send = False  # param.grad changed after the last step sent it (no effect)
        self.last_used_masks: list[Tensor] | None = None  # per bucket, the mask of the last sparse step
        self._step: StepInFlight | None = None
        self.ddp_dense = self.pilot is not None or cfg.every_step_dense_fp32  # fp32 dense steps as DDP's (form_switch)
        form_switch.take_ddp_form(self, fresh=True)
        if cfg.dense_steps == 0:
            self.masks.begin()

    # ------------------------------------------------------------------ public API

    @property
    def in_warmup(self) -> bool:
        """Whether the next step is a dense warm-up step."""
        return self.step_count < self.config.dense_steps

    @property
    def slots(self) -> int:
        """d N: mask slots over all ranks and buckets (the values sent per sparse step, before the ring)."""
        return sum(b.slots for b in self.buckets)

    @property
    def refresh_count(self) -> int:
        """How many times the masks have been built anew."""
        return self.masks.refresh_count

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
        zero_grads(self.buckets)

    @torch.no_grad()
    def step(self, max_grad_norm: float | None = None, clip_value: float | None = None) -> None:
        """Finish synchronising this step's gradients and update the parameters.

        A dense step (:meth:`_dense_step`) or a sparse one (:meth:`_sparse_step`), each written as its
        communication schedule. The value collectives were launched by the backward hooks; buckets that saw
        no backward launch their zeros here.

        Args:
            max_grad_norm: Clip the global norm of the synchronised gradient (the averaged compact
                values in sparse steps) to this value.
            clip_value: Clamp every synchronised gradient value to ``[-clip_value, clip_value]``.
        """
        if not self.buckets:  # every parameter frozen: nothing to send or update, and the step is not counted
            return
        step = self._open_step()
        step.launch_in_order(all_buckets=True)
        self.grads_written_after_send = step.grads_written_after_launch()
        if step.dense:
            self._dense_step(step, max_grad_norm, clip_value)
        else:
            self._sparse_step(step, max_grad_norm, clip_value)
        if self.pilot is not None and not self.last_step_skipped:
            self.pilot.after_step(self)

    def _dense_step(self, step: StepInFlight, max_grad_norm: float | None, clip_value: float | None) -> None:
        """A dense step (warm-up, and the ramp's dense steps), phase by phase."""
        # 1. Wait for every bucket's averaged gradient, in order.
        synced = step.synced_grads()
        # 2. fp16: a step with an inf/nan gradient on any rank is skipped on every rank.
        if self.skip_nonfinite and step.any_nonfinite():
            self._close_step(step, applied=False)
            return
        step.commit_staged()
        # 3. Clip the synchronised gradient.
        update.clip_(synced, self._clip_coef(step, max_grad_norm), clip_value)
        # 4. AdamS on this rank's region; sharded: launch each bucket's parameter all-gather at once.
        hypers = self._hypers(step.step, sparse=False)
        gathers: list[Pending | None] = []
        for bs, g in zip(self.buckets, synced, strict=True):
            gathers.append(update.dense_update(bs, g, update.for_bucket(hypers, bs), self.wire))
        # 5. Wait for the gathers in order.
        self.wire.wait_in_order(gathers)
        # 6. After the last dense step: the first masks; in the pilot's fp32 dense form, the next steps are DDP's.
        self._close_step(step, applied=True)
        if step.step == self.config.dense_steps:
            form_switch.end_dense_steps(self, step.step)
        form_switch.take_ddp_form(self)

    def _sparse_step(self, step: StepInFlight, max_grad_norm: float | None, clip_value: float | None) -> None:
        """A sparse step at the one-step-delayed mask, phase by phase."""
        masks = [self.masks.in_use(i) for i in range(len(self.buckets))]
        # 1. Wait for every bucket's averaged values at the mask, in order.
        synced = step.synced_grads()
        # 2. fp16: skip a step with an inf/nan on any rank; else the residual takes this step's gradient.
        if self.skip_nonfinite:
            if step.any_nonfinite():
                self._close_step(step, applied=False)
                return
            for bs, mask in zip(self.buckets, masks, strict=True):
                feedback.commit(bs, mask)
        self.last_used_masks = masks
        # 3. Clip the synchronised values.
        update.clip_(synced, self._clip_coef(step, max_grad_norm), clip_value)
        # 4. The interval AdamS update at the masked slots; sharded: launch each bucket's parameter gather.
        hypers = self._hypers(step.step, sparse=True)
        gathers: list[Pending | None] = []
        for bs, mask, g in zip(self.buckets, masks, synced, strict=True):
            gathers.append(update.sparse_update(bs, mask, g, update.for_bucket(hypers, bs), self.wire))
        # 5. Build the next masks (and launch their index all-gathers) while the parameter gathers are in flight.
        self.masks.after_sparse_step(step.step)
        # 6. Wait for the gathers in order, and write the new values at the mask.
        for bs, mask, pending in zip(self.buckets, masks, gathers, strict=True):
            if pending is not None:
                self.wire.wait(pending)
            update.apply_sparse(bs, mask, hypers[bs.layout.group_index].decay)
        # 7. Drop the masks this step used.
        self.masks.finish_sparse_step()
        self._close_step(step, applied=True)

    @torch.no_grad()
    def global_grad_norm(self) -> float:
        """Global L2 norm of this step's synchronised gradient, before clipping (call after backward; ``param.grad``
        holds this rank's own). Finishes the step's synchronisation early; sharded, one scalar all-reduce."""
        if not self.buckets:
            return 0.0
        step = self._open_step()
        step.launch_in_order(all_buckets=True)
        self.last_grad_norm = float(step.squared_norm().sqrt().item())
        return self.last_grad_norm

    def close(self, wait: bool = True) -> None:
        """Remove the gradient hooks and wait for collectives still in flight (``wait=False`` after a failure: drop
        them, as after a failed collective of the engine's)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if not wait or self.wire.failed:
            return
        self.masks.wait_all()
        if self._step is not None:
            self._step.wait_all()
            self._step = None

    def current_masks(self) -> list[Tensor]:
        """Per bucket, the mask the next sparse step will use (waits for its all-gather)."""
        return self.masks.next_masks()

    def last_built_masks(self) -> list[Tensor]:
        """Per bucket, the most recently built mask (waits for its all-gather)."""
        return self.masks.newest_masks()

    def add_trainable_params(self) -> int:
        """Lay out trainable parameters the engine does not hold yet (unfrozen, or in a param group added to the
        optimizer; :mod:`~lightning_scape.engine.joining`), between steps on every rank; returns how many joined."""
        return joining.join_trainable_params(self)

    def state_dict(self) -> dict[str, Any]:
        """This rank's SCAPE state (see :func:`lightning_scape.engine.state.engine_state`); every rank saves its own."""
        return state.engine_state(self)

    def check_state_dict(self, saved: Any) -> None:
        """Raise ``ValueError`` unless :meth:`load_state_dict` can restore ``saved`` exactly; changes nothing."""
        state.check_engine_state(self, saved)

    @torch.no_grad()
    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; refuses (changing nothing) a state that :meth:`check_state_dict` rejects."""
        state.load_engine_state(self, saved)

    def reshard_state_dicts(self, saved: Iterable[Any]) -> dict[str, Any]:
        """This rank's state, for :meth:`load_state_dict` (every rank loads it at the same point), from every rank's
        :meth:`state_dict` of a run on another world size, in rank order (an iterator is read one state at a time)."""
        return state.reshard_engine_state(self, saved)

    def grad_ready(self, param: Tensor) -> None:
        """``param``'s gradient is in its buffer, written outside autograd (FSDP's reduce-scatter): as the hook."""
        self._on_grad_ready(param)

    # ------------------------------------------------------------------ the step in flight

    def _on_grad_arriving(self, i: int, grad: Tensor) -> None:
        # Before a gradient accumulates into bucket i (also under no_sync, or it would miss this step's launches).
        if self._step is not None and self._step.launched(i):
            with torch.no_grad():
                self._step.reopen()

    def _on_grad_ready(self, p: Tensor) -> None:
        if not self.require_backward_grad_sync:
            return
        with torch.no_grad():
            self._open_step().grad_ready(self._bucket_index[id(p)])

    def _open_step(self) -> StepInFlight:
        if self._step is None:
            scale = None if self.loss_scale is None else float(self.loss_scale())
            t, dense = self.step_count + 1, self.in_warmup
            self._step = StepInFlight(
                self.buckets, self.config, self.wire, self.masks, t, dense, scale, self.skip_nonfinite
            )
        return self._step

    def _close_step(self, step: StepInFlight, applied: bool) -> None:
        step.close(applied)
        self.last_step_skipped = not applied
        if applied:
            self.step_count += 1
            self.counters.steps = self.step_count
        self._step = None

    def _clip_coef(self, step: StepInFlight, max_grad_norm: float | None) -> Tensor | None:
        """Global-norm clipping coefficient, as ``torch.nn.utils.clip_grad_norm_`` computes it."""
        if max_grad_norm is None:
            return None
        norm = step.squared_norm().sqrt()
        self.last_grad_norm = float(norm.item())
        return (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)

    def _hypers(self, t: int, sparse: bool) -> list[AdamSHyper]:
        """Per param group, step ``t``'s AdamS hyperparameters (sparse steps: the interval update's)."""
        hypers, self.peak_lr = update.step_hypers(self.optimizer.param_groups, t, self.config, self.peak_lr, sparse)
        return hypers


def _check_inputs(optimizer: Optimizer) -> None:
    """Refuse what the engine cannot run, before anything is built."""
    for g in optimizer.param_groups:
        missing = [k for k in ("lr", "betas", "eps", "weight_decay") if k not in g]
        if missing:
            raise ValueError(
                f"ScapeEngine needs AdamS-style param groups; this one lacks {missing}. "
                "Build the optimizer as lightning_scape.AdamS(params, ...)."
            )
