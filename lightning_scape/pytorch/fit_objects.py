"""The SCAPE optimizers and the engine of a Trainer strategy's current fit (a mixin of both Trainer forms)."""

from __future__ import annotations

from typing import Any

from lightning_scape.engine import ScapeEngine
from lightning_scape.runtime.optimizer import ScapeOptimizer, scape_optimizers


class FitObjects:
    """What the Trainer's SCAPE strategies hand out of the current fit: its SCAPE optimizers and their engine."""

    @property
    def scape_optimizers(self) -> list[ScapeOptimizer]:
        """The SCAPE optimizers of the current fit (normally one)."""
        optimizers: list[Any] = getattr(self, "optimizers", [])  # Lightning's Strategy.optimizers
        return list(scape_optimizers(optimizers))

    @property
    def engine(self) -> ScapeEngine:
        """The :class:`~lightning_scape.ScapeEngine` of the current fit (the FSDP form's: this rank's shard)."""
        opts = self.scape_optimizers
        if not opts:
            raise RuntimeError(
                f"{type(self).__name__} has no engine outside trainer.fit (after the optimizers are set up)."
            )
        return opts[0].engine
