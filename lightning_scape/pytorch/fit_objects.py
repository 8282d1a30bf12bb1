"""What both Trainer strategies do beyond their form: the current fit's SCAPE optimizers and engine, the schedule's
notice before the first batch, a failed fit remembered (a mixin of both Trainer forms)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl

from lightning_scape.engine import ScapeEngine
from lightning_scape.pytorch import clipping
from lightning_scape.runtime.optimizer import ScapeOptimizer, scape_optimizers
from lightning_scape.runtime.run_notices import RunNotices

if TYPE_CHECKING:  # the strategy this mixin is combined with, for the hooks it extends
    from lightning.pytorch.strategies.strategy import Strategy as _Strategy
else:
    _Strategy = object


class FitObjects(RunNotices, _Strategy):
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

    def on_train_start(self) -> None:
        """Warn (:meth:`warn_if_all_dense`) before the first training batch, once the train dataloader exists.

        Not at set-up: ``trainer.estimated_stepping_batches`` would build the train dataloader before
        ``on_fit_start``, out of Lightning's hook order.
        """
        super().on_train_start()
        assert self.lightning_module is not None
        self.warn_if_all_dense(planned_steps(self.lightning_module.trainer))

    def _end_fit(self) -> None:
        """At teardown: close the engines (without waiting on collectives after a failure), sum the fit up (rank 0),
        and give the precision plugin its own clipping back."""
        self._close_run()
        clipping.restore(self.precision_plugin)

    def on_exception(self, exception: BaseException) -> None:
        """Remember a failure: teardown then waits on no collective that will never finish, and a failed fit is
        not summed up."""
        self._failed = True
        super().on_exception(exception)


def state_key(index: int) -> str:
    """The key of a checkpoint's ``optimizer_states[index]`` in the SCAPE checkpoint files (both Trainer forms)."""
    return f"optimizer_states.{index}"


def planned_steps(trainer: pl.Trainer) -> float | None:
    """The optimizer steps the fit will take (``trainer.estimated_stepping_batches``), None if not known."""
    try:
        return float(trainer.estimated_stepping_batches)
    except Exception:  # no train dataloader yet, an unsized one, ...: the notice then comes at the end
        return None
