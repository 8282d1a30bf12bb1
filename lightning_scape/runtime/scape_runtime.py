"""The SCAPE side of a strategy, written once for the four (Fabric and Trainer, DDP and FSDP forms).

:class:`ScapeRuntime` is one object per strategy. It holds what the strategy set up (its modules and SCAPE
optimizers) and does everything beyond translating Lightning's hooks: the engine built through the form's
:class:`~lightning_scape.runtime.parameter_holding.ParameterHolding`, clipping by the global norm or by value, a
failure remembered, the schedule's notices, and the end of a run (engines closed without waiting after a failure,
the notice of a run that never left its dense steps, the summary). :class:`RuntimeFacade` gives a strategy the
names its users call (``engine``, ``run_summary()``, ``warn_if_all_dense()``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_scape.config import ScapeConfig
from lightning_scape.engine import ScapeEngine
from lightning_scape.planning.run_summary import summary_text
from lightning_scape.runtime import engine_setup, registry
from lightning_scape.runtime.optimizer import ScapeOptimizer, unwrap_optimizer
from lightning_scape.runtime.options import RunSettings
from lightning_scape.runtime.parameter_holding import ParameterHolding
from lightning_scape.runtime.warmup_notice import Syntax, WarmupNotice, call_at_exit

if TYPE_CHECKING:
    from torch.amp import GradScaler


class ScapeRuntime:
    """One strategy's SCAPE run: its set-up objects, clipping, failure, notices and end (``docs/lightning.md``)."""

    def __init__(
        self,
        owner: str,
        config: ScapeConfig,
        settings: RunSettings,
        holding: ParameterHolding,
        setup_call: str | None = None,
    ) -> None:
        """The runtime of one strategy, built in its constructor.

        Args:
            owner: The strategy's class name, for messages.
            config: The SCAPE configuration.
            settings: The strategy's timeout and load setting.
            holding: How the form's engines hold the parameters.
            setup_call: Fabric's call that sets an optimizer up (for the error before one is); None under the
                Trainer, whose runs are fits: each fit's optimizer replaces the last, and its end is the strategy's
                teardown.
        """
        self.owner = owner
        self.config = config
        self.settings = settings
        self.holding = holding
        self.setup_call = setup_call
        self.log_summary = True  # lightning-scape pretrain and the demo print the summary's lines themselves
        self.failed = False
        self._modules: list[Module] = []
        self._optimizers: list[ScapeOptimizer] = []
        self._planned: tuple[float | None, Syntax] | None = None  # until an engine gives the layout
        self._notice: WarmupNotice | None = None
        self._summary_given = False
        self._exit_hook = False

    # ------------------------------------------------------------------------------------- set-up objects

    @property
    def optimizers(self) -> list[ScapeOptimizer]:
        """The SCAPE optimizers set up, in set-up order (normally one)."""
        return list(self._optimizers)

    @property
    def modules(self) -> list[Module]:
        """The modules set up (Fabric), in set-up order."""
        return list(self._modules)

    @property
    def engine(self) -> ScapeEngine:
        """The engine of the most recently set-up optimizer (this rank's part)."""
        return self._newest().engine

    def _newest(self) -> ScapeOptimizer:
        if not self._optimizers:
            if self.setup_call is None:
                raise RuntimeError(f"{self.owner} has no engine outside trainer.fit (after the optimizers are set up).")
            raise RuntimeError(f"No optimizer was set up yet: call {self.setup_call} first.")
        return self._optimizers[-1]

    def add_module(self, module: Module) -> None:
        """Remember a module Fabric set up (its optimizer may come later)."""
        self._modules.append(module)

    def module_of(self, optimizer: Optimizer) -> Module | None:
        """The most recently set-up module holding any of ``optimizer``'s parameters (None: no such module)."""
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        return next((m for m in reversed(self._modules) if any(id(p) in ids for p in m.parameters())), None)

    def start_fit(self) -> None:
        """A Trainer's new fit: its optimizer replaces the last one's, and it may be told and summed up again."""
        self.failed = False
        self._optimizers.clear()
        self._notice = None
        self._planned = None
        self._summary_given = False

    def set_up(self, optimizer: Optimizer, module: Module | None, scaler: GradScaler | None = None) -> ScapeOptimizer:
        """Hand ``optimizer`` to an engine over ``module`` (the form's holding builds it) and keep it.

        Args:
            optimizer: The user's AdamS, AdamW or Adam.
            module: The set-up model it steps (None: the parameters in param-group order; the replicated form only).
            scaler: The precision plugin's enabled ``GradScaler`` (fp16 mixed precision), if any.

        Returns:
            The optimizer to hand back to Lightning.
        """
        scape = self.holding.build(optimizer, module, self.config, self.settings, scaler)
        self._optimizers.append(scape)
        self._check_schedule()
        if self.setup_call is not None and not self._exit_hook:  # Fabric does not tell its strategy a run ended
            call_at_exit(self.end_of_run)
            self._exit_hook = True
        return scape

    def optimizer_of(self, optimizer: Any) -> ScapeOptimizer:
        """``optimizer`` (Fabric's wrapper or not) as the :class:`ScapeOptimizer` this runtime handed back."""
        opt = unwrap_optimizer(optimizer)
        if not isinstance(opt, ScapeOptimizer):
            call = self.setup_call or "configure_optimizers"
            raise TypeError(f"Expected the optimizer returned by {call} (a ScapeOptimizer), got {type(opt).__name__}.")
        return opt

    # -------------------------------------------------------------------------------------- a step

    @contextmanager
    def failure_remembered(self) -> Iterator[None]:
        """A step that raises marks the run failed, so that its end waits on no collective that cannot finish."""
        try:
            yield
        except BaseException:
            self.failed = True
            raise

    def clip_norm(
        self, optimizer: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = True
    ) -> float:
        """Clip the coming step's synchronised gradient to global L2 norm ``max_norm``; the norm before clipping.

        Raises:
            ValueError: ``norm_type`` is not 2.
            RuntimeError: The norm is inf or nan and ``error_if_nonfinite`` (without fp16 loss scaling, whose
                step is skipped instead).
        """
        opt = self.optimizer_of(optimizer)
        if float(norm_type) != 2.0:
            raise ValueError(
                f"{self.owner} clips by the global L2 norm of the synchronised gradient; norm_type={norm_type} is "
                "not supported. Use norm_type=2."
            )
        norm = self.holding.request_global_clip(opt, float(max_norm))
        if error_if_nonfinite and not math.isfinite(norm) and opt.engine.loss_scale is None:
            raise RuntimeError(
                f"The global norm of the synchronised gradient is {norm}. Pass error_if_nonfinite=False to skip "
                "this check, or find the source of the inf/nan (learning rate too high?)."
            )
        return norm

    def request_norm_clip(self, optimizer: Any, max_norm: float) -> None:
        """Clip the coming step to global norm ``max_norm`` without returning the norm (the Trainer's
        ``gradient_clip_val``): the replicated form then computes none ahead of the step."""
        self.holding.request_clip(self.optimizer_of(optimizer), float(max_norm))

    def clip_value(self, optimizer: Any, clip_val: float) -> None:
        """Clamp every synchronised gradient value of the coming step to ``[-clip_val, clip_val]``."""
        self.optimizer_of(optimizer).request_clip(clip_value=float(clip_val))

    def global_grad_norm(self) -> float:
        """The global L2 norm of this step's synchronised gradient, over the whole model."""
        return self.holding.global_norm(self._newest())

    # ------------------------------------------------------------------------------------------ notices

    def warn_if_all_dense(self, planned_steps: float | None, syntax: Syntax = "python") -> None:
        """The schedule's notice before a run whose length is known (:meth:`RuntimeFacade.warn_if_all_dense`)."""
        self._planned = (planned_steps, syntax)
        self._check_schedule()

    def _check_schedule(self) -> None:
        """The notice of :meth:`warn_if_all_dense`, once an engine gives the layout (an all-dense run: at once)."""
        if self._planned is None:
            return
        planned, syntax = self._planned
        layout = [bs.layout for bs in self._optimizers[-1].engine.buckets] if self._optimizers else None
        if layout is None and planned is not None and planned > self.config.dense_steps:
            return  # wait for the layout (the optimizer's set-up calls this again)
        self._schedule_notice.before_run(self.config, planned, layout, self.holding.ranks(), syntax)
        self._planned = None

    @property
    def _schedule_notice(self) -> WarmupNotice:
        if self._notice is None:
            self._notice = WarmupNotice(self.owner)
        return self._notice

    # ------------------------------------------------------------------------------------------- the end

    def close(self) -> None:
        """The strategy's teardown: close the engines (waiting on no collective after a failure; the heartbeat
        stops) and the holding's hooks, then :meth:`end_of_run`."""
        # Closed first: the wait for the last mask's all-gather, still in flight, belongs in the summary.
        engine_setup.close_engines(self._optimizers, wait=not self.failed)
        self.holding.close()
        self.end_of_run()  # a run whose length was not known at the start (early stopping, ...) is told now

    def end_of_run(self) -> None:
        """Unless the run failed: warn if it never left its dense steps, and log its summary (rank 0, once)."""
        if self.failed or any(opt.engine.wire.failed for opt in self._optimizers):
            return
        for opt in self._optimizers:
            self._schedule_notice.after_run(opt.engine, self.holding.ranks())
        self.log_run_summary()

    def run_summary(self) -> str:
        """What SCAPE did in the run so far (:meth:`RuntimeFacade.run_summary`)."""
        return summary_text([opt.engine for opt in self._optimizers], self.holding.baseline)

    def log_run_summary(self) -> None:
        """Log :meth:`run_summary` on rank 0, once per run, if the run stepped and ``log_summary`` is on."""
        engines = [opt.engine for opt in self._optimizers if opt.engine.step_count > 0]
        if self._summary_given or not self.log_summary or not engines:
            return
        self._summary_given = True
        rank_zero_info(summary_text(engines, self.holding.baseline))


class RuntimeFacade:
    """The names a SCAPE strategy's users call, answered by its :class:`ScapeRuntime` (a mixin of the four)."""

    scape_runtime: ScapeRuntime
    root_device: torch.device  # Lightning's Strategy.root_device

    @property
    def scape_config(self) -> ScapeConfig:
        """The strategy's SCAPE configuration."""
        return self.scape_runtime.config

    @property
    def scape_run(self) -> RunSettings:
        """The strategy's timeout and load setting."""
        return self.scape_runtime.settings

    @property
    def scape_optimizers(self) -> list[ScapeOptimizer]:
        """The SCAPE optimizers of the run (Fabric: every one set up, in set-up order; the Trainer: the fit's)."""
        return self.scape_runtime.optimizers

    @property
    def engine(self) -> ScapeEngine:
        """The :class:`~lightning_scape.ScapeEngine` of the most recently set-up optimizer (this rank's part)."""
        return self.scape_runtime.engine

    @property
    def log_run_summary(self) -> bool:
        """Whether rank 0 logs :meth:`run_summary` at the end of a run (default True)."""
        return self.scape_runtime.log_summary

    @log_run_summary.setter
    def log_run_summary(self, value: bool) -> None:
        self.scape_runtime.log_summary = value

    def run_summary(self) -> str:
        """What SCAPE did in the run so far, as rank 0 logs it at its end: the bytes this process sent against what
        DDP (HSDP for ``ScapeFSDPStrategy``) would have sent, the time it waited on SCAPE's collectives, and the
        steps of each phase (dense warm-up, density ramp, sparse); counted since the run began, a resumed run
        included."""
        return self.scape_runtime.run_summary()

    def global_grad_norm(self) -> Tensor:
        """The global L2 norm of this step's synchronised gradient (over every rank's part); call it after backward,
        before the step (in ``on_before_optimizer_step`` under the Trainer).

        What DDP users compute from ``param.grad``, which here holds this rank's own gradient
        (``docs/lightning.md``). It finishes the step's synchronisation early, at no cost when the step follows.
        Under ``ScapeFSDPStrategy`` it adds the shards' parts with one all-reduce over the shard group: call it on
        every rank, not under ``if trainer.is_global_zero``.
        """
        return torch.tensor(self.scape_runtime.global_grad_norm(), device=self.root_device)

    def warn_if_all_dense(self, planned_steps: float | None, syntax: Syntax = "python") -> None:
        """Warn once, on rank 0, if the run's steps would all be sent dense (a ``DenseWarmupWarning``), or would end
        inside the density ramp or send more than a quarter of DDP's bytes (then with a schedule scaled to the run).

        The Trainer's strategies call it before the first training batch with ``estimated_stepping_batches``.
        Fabric does not know how long a run will be, so without this call a run that never left its dense steps is
        told at its end: a training loop that knows its length (``lightning-scape pretrain``) calls it before the
        first step, while the schedule can still be changed. Called before the optimizer is set up, the bytes are
        computed (and the warning given) once it is.

        Args:
            planned_steps: The optimizer steps the run will take; None or inf when not known (then nothing is
                said now).
            syntax: How the message writes the settings: ``"python"`` (``ScapeStrategy(...)``) or ``"cli"``
                (``--scape.dense_warmup_steps N``, the ``pretrain`` command's flags).
        """
        self.scape_runtime.warn_if_all_dense(planned_steps, syntax)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """The names of ``registry.NAMES`` for this class: ``"scape"`` (processes started like ``"ddp"``) and
        ``"scape_spawn"`` (like ``"ddp_spawn"``) for ``ScapeStrategy``, ``"scape_fsdp"`` for ``ScapeFSDPStrategy``."""
        registry.register_strategies(cls, strategy_registry)
