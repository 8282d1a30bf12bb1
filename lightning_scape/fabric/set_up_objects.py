"""What a Fabric SCAPE strategy has set up: its modules and SCAPE optimizers, and the engine of the latest."""

from __future__ import annotations

from torch.nn import Module

from lightning_scape.engine import ScapeEngine
from lightning_scape.wiring.optimizer import ScapeOptimizer


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
