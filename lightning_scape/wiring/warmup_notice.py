"""The notice of a run too short to leave SCAPE's dense steps (:class:`DenseWarmupWarning`)."""

from __future__ import annotations

import atexit
import math
import weakref
from collections.abc import Callable

from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_scape.config import ScapeConfig
from lightning_scape.engine import ScapeEngine


class DenseWarmupWarning(UserWarning):
    """The warning of :class:`WarmupNotice`: a run that never leaves SCAPE's dense steps (filter it by category)."""


class WarmupNotice:
    """Says once, on rank 0, that a run is too short to leave its dense warm-up.

    A run that never leaves ``dense_warmup_steps`` sends the whole gradient at every step, as DDP does, and
    never shows what SCAPE does. Where the length of the run is known before it starts (the Trainer's
    ``estimated_stepping_batches``, the ``pretrain`` command's token budget) the warning comes then, while the
    user can still change the warm-up; otherwise (Fabric) it comes at the end of the run.
    """

    def __init__(self) -> None:
        self.given = False

    def before_run(self, config: ScapeConfig, planned_steps: float | None) -> None:
        """Warn if ``planned_steps`` optimizer steps (None or inf: not known) are all sent dense."""
        if self.given or planned_steps is None or not math.isfinite(planned_steps) or planned_steps < 1:
            return
        steps = int(planned_steps)
        if steps > config.dense_steps:
            return
        self.given = True
        rank_zero_warn(
            f"lightning_scape: this run has {steps} optimizer steps, {_all_dense(config, steps)}",
            category=DenseWarmupWarning,
        )

    def after_run(self, engine: ScapeEngine) -> None:
        """Warn if ``engine`` stepped, but never sparsely."""
        if self.given or not 0 < engine.step_count <= engine.config.dense_steps:
            return
        self.given = True
        rank_zero_warn(
            f"lightning_scape: the run ended after {engine.step_count} optimizer steps, "
            + _all_dense(engine.config, engine.step_count),
            category=DenseWarmupWarning,
        )


def _all_dense(config: ScapeConfig, steps: int) -> str:
    return (
        f"all sent dense by SCAPE's warm-up (dense_warmup_steps={config.dense_warmup_steps}, and the first "
        f"{config.dense_steps - config.dense_warmup_steps} of density_ramp_steps={config.density_ramp_steps}): "
        "every step sends the whole gradient, as DDP does, and no step is sparse. For a run this short pass a "
        f"smaller warm-up, e.g. ScapeStrategy(dense_warmup_steps={max(1, steps * 3 // 100)}, "
        f"density_ramp_steps={steps * 2 // 5})."
    )


def call_at_exit(method: Callable[[], None]) -> None:
    """Call the bound ``method`` when the interpreter exits, unless its object is gone by then."""
    atexit.register(_call_if_alive, weakref.WeakMethod(method))


def _call_if_alive(ref: weakref.WeakMethod[Callable[[], None]]) -> None:
    method = ref()
    if method is not None:
        method()
