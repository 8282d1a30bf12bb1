"""The Fabric hooks both Fabric SCAPE strategies answer through their runtime: the step (a failure remembered,
fp16 loss scaling), clipping, teardown, what ``fabric.load`` restores beside models and optimizers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.types import Optimizable, _Stateful
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_scape.runtime import loss_scaling
from lightning_scape.runtime.optimizer import ScapeOptimizer, unwrap_optimizer
from lightning_scape.runtime.scape_runtime import RuntimeFacade

if TYPE_CHECKING:  # the strategy this mixin is combined with, for the hooks it extends
    from lightning.fabric.strategies.strategy import Strategy as _Strategy
else:
    _Strategy = object


class FabricRuntimeHooks(RuntimeFacade, _Strategy):
    """Fabric's hooks answered by the :class:`~lightning_scape.runtime.scape_runtime.ScapeRuntime` (both forms)."""

    @property
    def scape_modules(self) -> list[Module]:
        """The modules this strategy set up, in set-up order."""
        return self.scape_runtime.modules

    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """The SCAPE step; with fp16 loss scaling the ``GradScaler`` learns whether it was skipped. A failure is
        remembered, so that teardown waits on no collective that cannot finish."""
        opt = unwrap_optimizer(optimizer)
        scaler = loss_scaling.grad_scaler_of(self.precision)
        with self.scape_runtime.failure_remembered():
            if scaler is None or not isinstance(opt, ScapeOptimizer):
                return super().optimizer_step(optimizer, **kwargs)
            out = opt.step(**kwargs)
        loss_scaling.report_step_to_scaler(scaler, opt)
        return out

    def teardown(self) -> None:
        """Remove the engines' hooks (without waiting on collectives when a rank failed) and the holding's, stop the
        heartbeat, log the run's summary."""
        self.scape_runtime.close()
        super().teardown()

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip the synchronised gradient to global L2 norm ``max_norm`` (over every rank's part) in the coming step.

        Returns:
            The global norm before clipping. Computing it finishes the step's synchronisation early, which costs
            nothing when ``optimizer.step()`` follows.

        Raises:
            ValueError: ``norm_type`` is not 2.
            RuntimeError: The norm is inf or nan and ``error_if_nonfinite`` (without fp16 loss scaling, whose
                step is skipped instead).
        """
        norm = self.scape_runtime.clip_norm(optimizer, float(max_norm), float(norm_type), error_if_nonfinite)
        return torch.tensor(norm, device=self.root_device)

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clamp every synchronised gradient value to ``[-clip_val, clip_val]`` in the coming step."""
        self.scape_runtime.clip_value(optimizer, float(clip_val))

    @staticmethod
    def _restore_values(state: dict[str, Any], saved: dict[str, Any], keys: Iterable[str]) -> None:
        """Lightning's rule for what ``fabric.load`` restores beside models and optimizers: each of ``keys`` found in
        ``saved`` leaves it; a stateful object loads it, any other value replaces the one in ``state``."""
        for key in keys:
            if key not in saved:
                continue
            if isinstance(state[key], _Stateful):
                state[key].load_state_dict(saved.pop(key))
            else:
                state[key] = saved.pop(key)
