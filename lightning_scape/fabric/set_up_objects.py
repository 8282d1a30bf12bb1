"""What a Fabric SCAPE strategy has set up: its modules and SCAPE optimizers, and the engine of the latest."""

from __future__ import annotations

from typing import Any

from torch.nn import Module
from torch.optim import Optimizer

from lightning_scape.engine import ScapeEngine
from lightning_scape.runtime.optimizer import ScapeOptimizer, unwrap_optimizer


class SetUpObjects:
    """The modules and SCAPE optimizers a Fabric strategy set up, in set-up order (a mixin of both forms)."""

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
