"""What both Fabric SCAPE strategies do with what they set up: their modules and SCAPE optimizers, a step that fails,
clipping by the global norm."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.types import _Stateful
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_scape.engine import ScapeEngine
from lightning_scape.runtime.optimizer import ScapeOptimizer, unwrap_optimizer
from lightning_scape.runtime.run_notices import RunNotices


class SetUpObjects(RunNotices):
    """The modules and SCAPE optimizers a Fabric strategy set up, in set-up order (a mixin of both forms)."""

    root_device: torch.device  # Lightning's Strategy.root_device

    # What the user must call before an engine exists, for the error.
    _setup_call = "fabric.setup(model, optimizer)"

    def _start_set_up_objects(self) -> None:
        """Called from the strategy's ``__init__`` (not ``__init__`` itself: it stays out of the strategies' MRO)."""
        self._scape_modules: list[Module] = []
        self._scape_optimizers: list[ScapeOptimizer] = []

    @property
    def scape_optimizers(self) -> list[ScapeOptimizer]:
        """The optimizers this strategy set up, in set-up order (normally one)."""
        return list(self._scape_optimizers)

    @property
    def scape_modules(self) -> list[Module]:
        """The modules this strategy set up, in set-up order."""
        return list(self._scape_modules)

    @property
    def engine(self) -> ScapeEngine:
        """The :class:`~lightning_scape.ScapeEngine` of the most recently set-up optimizer (this rank's part)."""
        if not self._scape_optimizers:
            raise RuntimeError(f"No optimizer was set up yet: call {self._setup_call} first.")
        return self._scape_optimizers[-1].engine

    def _adopt(self, scape: ScapeOptimizer) -> ScapeOptimizer:
        """Keep ``scape`` as the newest optimizer, and give the run's notices their layout."""
        self._scape_optimizers.append(scape)
        self._check_schedule()
        self._end_at_exit()  # Fabric does not know when a run ends: its notices come at teardown, or at exit
        return scape

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

    @contextmanager
    def _failure_remembered(self) -> Iterator[None]:
        """A step that raises marks the run failed, so that teardown waits on no collective that cannot finish."""
        try:
            yield
        except BaseException:
            self._failed = True
            raise

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
        opt = self._scape_optimizer_of(optimizer)
        name = type(self).__name__
        if float(norm_type) != 2.0:
            raise ValueError(
                f"{name} clips by the global L2 norm of the synchronised gradient; norm_type={norm_type} is not "
                "supported. Use norm_type=2."
            )
        norm = self._request_global_clip(opt, float(max_norm))
        if error_if_nonfinite and not math.isfinite(norm) and opt.engine.loss_scale is None:
            raise RuntimeError(
                f"The global norm of the synchronised gradient is {norm}. Pass error_if_nonfinite=False to skip "
                "this check, or find the source of the inf/nan (learning rate too high?)."
            )
        return torch.tensor(norm, device=self.root_device)

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clamp every synchronised gradient value to ``[-clip_val, clip_val]`` in the coming step."""
        self._scape_optimizer_of(optimizer).request_clip(clip_value=float(clip_val))

    def _request_global_clip(self, opt: ScapeOptimizer, max_norm: float) -> float:
        """Clip ``opt``'s coming step to global norm ``max_norm``; the norm before clipping (the form's own sum)."""
        raise NotImplementedError

    def _module_of(self, optimizer: Optimizer) -> Module | None:
        """The most recently set-up module holding any of ``optimizer``'s parameters (None: no such module)."""
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        return next((m for m in reversed(self._scape_modules) if any(id(p) in ids for p in m.parameters())), None)

    def _scape_optimizer_of(self, optimizer: Any) -> ScapeOptimizer:
        """``optimizer`` (Fabric's wrapper or not) as the :class:`ScapeOptimizer` this strategy handed back."""
        opt = unwrap_optimizer(optimizer)
        if not isinstance(opt, ScapeOptimizer):
            raise TypeError(
                f"Expected the optimizer returned by {self._setup_call} (a ScapeOptimizer), got {type(opt).__name__}."
            )
        return opt
