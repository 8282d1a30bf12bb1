"""The Trainer hooks both Trainer SCAPE strategies answer through their runtime: the fit's optimizer handed to an
engine, the fp16 step, the notices before the first batch, a failed fit remembered, the end of a fit."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from torch.nn import Module
from torch.optim import Optimizer

from lightning_scape.comm import rank_failures
from lightning_scape.pytorch import clipping
from lightning_scape.runtime import local_grads, loss_scaling, setup_checks
from lightning_scape.runtime.optimizer import ScapeOptimizer, unwrap_optimizer
from lightning_scape.runtime.scape_runtime import RuntimeFacade

if TYPE_CHECKING:  # the strategy this mixin is combined with, for the hooks it extends
    from lightning.pytorch.strategies.strategy import Strategy as _Strategy
else:
    _Strategy = object


class TrainerRuntimeHooks(RuntimeFacade, _Strategy):
    """The Trainer's hooks answered by the :class:`~lightning_scape.runtime.scape_runtime.ScapeRuntime` (both forms)."""

    _grad_norm_notice: local_grads.LocalGradNormNotice | None = None

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Create the user's optimizer and schedulers, then hand the optimizer to a SCAPE engine."""
        runtime = self.scape_runtime
        with rank_failures.agreed(f"Setting up the optimizer for {runtime.owner}"):  # reported once, by rank 0
            super().setup_optimizers(trainer)
            if any(isinstance(opt, _MockOptimizer) for opt in self.optimizers):  # what Lightning puts in for None
                raise ValueError(
                    f"configure_optimizers returned None, but {runtime.owner} steps the optimizer itself (a fit "
                    "without an optimizer has nothing to synchronise gradients for). Return "
                    "lightning_scape.AdamS(self.parameters(), lr=...), or a torch.optim.AdamW / Adam, from "
                    "configure_optimizers."
                )
            optimizer = setup_checks.the_one_optimizer(runtime.owner, self.optimizers, "configure_optimizers returned")
            scaler = loss_scaling.grad_scaler_of(self.precision_plugin)
            scape = runtime.set_up(optimizer, self.model, scaler)
        self.optimizers = [scape]
        if not self.lr_scheduler_configs:  # a constant rate, known before the first step
            scape.tell_no_lr_scheduler()

    def on_train_start(self) -> None:
        """Warn (:meth:`warn_if_all_dense`) before the first training batch, once the train dataloader exists.

        Not at set-up: ``trainer.estimated_stepping_batches`` would build the train dataloader before
        ``on_fit_start``, out of Lightning's hook order.
        """
        super().on_train_start()
        assert self.lightning_module is not None
        self.warn_if_all_dense(planned_steps(self.lightning_module.trainer))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Warn once if the metrics logged so far hold Lightning's ``grad_norm`` of ``param.grad`` (local values)."""
        super().on_train_batch_start(batch, batch_idx)
        module = self.lightning_module
        results = None if module is None else module.trainer._results
        if self._grad_norm_notice is None:
            self._grad_norm_notice = local_grads.LocalGradNormNotice()
        if results is not None and not self._grad_norm_notice.given:
            self._grad_norm_notice.check(results.keys())

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """The SCAPE step (clipping requests from ``gradient_clip_val`` apply to the synchronised gradient)."""
        opt = unwrap_optimizer(optimizer)
        scaler = loss_scaling.grad_scaler_of(self.precision_plugin)
        if scaler is None or not isinstance(opt, ScapeOptimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        assert isinstance(model, pl.LightningModule)
        # The plain (not the mixed-precision) plugin logic: closure, hooks, clipping requests, then the SCAPE
        # step. GradScaler's own unscale_/step would touch gradients that the engine has already sent; the
        # engine divided the scale out in its hooks and skips non-finite steps on every rank.
        out = Precision.optimizer_step(self.precision_plugin, opt, model=model, closure=closure, **kwargs)
        loss_scaling.report_step_to_scaler(scaler, opt)
        return out

    def on_exception(self, exception: BaseException) -> None:
        """Remember a failure: teardown then waits on no collective that will never finish, and a failed fit is
        not summed up."""
        self.scape_runtime.failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """Close the engines (without waiting on collectives after a failure) and the holding's hooks, sum the fit up
        (rank 0), give the precision plugin its own clipping back; then Lightning's teardown."""
        self.scape_runtime.close()
        clipping.restore(self.precision_plugin)
        super().teardown()


def state_key(index: int) -> str:
    """The key of a checkpoint's ``optimizer_states[index]`` in the SCAPE checkpoint files (both Trainer forms)."""
    return f"optimizer_states.{index}"


def planned_steps(trainer: pl.Trainer) -> float | None:
    """The optimizer steps the fit will take (``trainer.estimated_stepping_batches``), None if not known."""
    try:
        return float(trainer.estimated_stepping_batches)
    except Exception:  # no train dataloader yet, an unsized one, ...: the notice then comes at the end
        return None
