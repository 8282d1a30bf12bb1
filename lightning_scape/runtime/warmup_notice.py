"""The notice of a run whose schedule does not fit its length (:class:`DenseWarmupWarning`): too short to leave
SCAPE's dense steps, ending inside the density ramp, or sending more than a quarter of DDP's bytes."""

from __future__ import annotations

import atexit
import math
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Literal

from lightning.fabric.utilities.rank_zero import rank_zero_only, rank_zero_warn

from lightning_scape.config import DENSE_ABOVE, DENSE_FOREVER, ScapeConfig
from lightning_scape.engine import ScapeEngine
from lightning_scape.engine.layout import Bucket
from lightning_scape.planning.run_traffic import run_bytes
from lightning_scape.warnings import DenseWarmupWarning

# "python": ScapeStrategy(name=value, ...); "cli": lightning-scape pretrain's --scape.name value.
Syntax = Literal["python", "cli"]
# A run on the default schedule that sends more than this fraction of DDP's bytes is told of one that fits it.
MAX_FRACTION_OF_DDP = 0.25
_DEFAULT_SCHEDULE = (ScapeConfig().dense_warmup_steps, ScapeConfig().density_ramp_steps)


class WarmupNotice:
    """Says once, on rank 0, that a run's schedule does not fit its length.

    A run that never leaves ``dense_warmup_steps`` sends the whole gradient at every step, as DDP does, and
    never shows what SCAPE does (unless it chose to: :func:`dense_on_purpose`); one that ends inside the density
    ramp, or sends more than a quarter of DDP's bytes, saves little. Where the length of the run is known before
    it starts (the Trainer's ``estimated_stepping_batches``, the ``pretrain`` command's token budget) the
    warning comes then, with a schedule scaled to the run, while the user can still change it; otherwise
    (Fabric) a run that never left its dense steps is told at its end.
    """

    def __init__(self, strategy: str = "ScapeStrategy") -> None:
        """``strategy``: the class whose constructor the suggested settings are written for."""
        self.given = False
        self.strategy = strategy

    def before_run(
        self,
        config: ScapeConfig,
        planned_steps: float | None,
        layout: Sequence[Bucket] | None = None,
        world_size: int | None = None,
        syntax: Syntax = "python",
    ) -> None:
        """Warn if ``planned_steps`` optimizer steps (None or inf: not known) are all sent dense, or, given the
        engine's ``layout`` on ``world_size`` ranks, end inside the density ramp or (on the default schedule) send
        more than a quarter of DDP's bytes; the message suggests a schedule scaled to the run, in ``syntax``.
        A run of one process (``world_size=1``; None: not known) sends nothing, dense or not: the strategies'
        ``OneProcessWarning`` says so instead."""
        if self.given or planned_steps is None or not math.isfinite(planned_steps) or planned_steps < 1:
            return
        if world_size == 1:
            return
        steps = int(planned_steps)
        if dense_on_purpose(config, steps):
            return
        if steps <= config.dense_steps:
            self._say(
                f"this run has {steps} optimizer steps, {_all_dense(config, steps, syntax, self.strategy)}", syntax
            )
        elif layout and world_size:
            message = _misfit(config, steps, layout, world_size, syntax, self.strategy)
            if message:
                self._say(message, syntax)

    def _say(self, message: str, syntax: Syntax) -> None:
        self.given = True
        if syntax == "cli":  # the command line's own voice, without the warnings module's source path
            _print_rank_zero(f"lightning-scape pretrain: warning: {message}")
        else:
            rank_zero_warn(f"lightning_scape: {message}", category=DenseWarmupWarning)

    def after_run(self, engine: ScapeEngine, world_size: int | None = None) -> None:
        """Warn if ``engine`` stepped, but never sparsely, unless the run had one process (``world_size=1``: the
        ``OneProcessWarning`` told it that nothing is sent)."""
        steps, config = engine.step_count, engine.config
        if self.given or not 0 < steps <= config.dense_steps or dense_on_purpose(config, steps) or world_size == 1:
            return
        self.given = True
        rank_zero_warn(
            f"lightning_scape: the run ended after {steps} optimizer steps, "
            + _all_dense(config, steps, "python", self.strategy),
            category=DenseWarmupWarning,
        )


def dense_on_purpose(config: ScapeConfig, steps: int) -> bool:
    """Whether a run of ``steps`` is dense by choice: the int8 wire with a warm-up as long as the run, which
    steps AdamS on the whole gradient at a quarter of DDP's bytes (``ScapeConfig.wire_format``)."""
    if config.chooses_form or config.dense_warmup_steps == DENSE_FOREVER:  # SCAPE chose dense steps, or the user
        return True
    return config.wire_format == "int8" and config.dense_warmup_steps >= steps


def _all_dense(config: ScapeConfig, steps: int, syntax: Syntax, strategy: str) -> str:
    """Why every step of a run of ``steps`` is dense, and what to pass instead."""
    if config.sparse_density > DENSE_ABOVE:
        # Not the warm-up: a step that dense is sent dense (a sparse one would send more than the whole gradient).
        density = "--scape.density 0.01" if syntax == "cli" else f"{strategy}(density=0.01)"
        return (
            f"all sent dense: density={config.sparse_density:g} is above 1/4, and SCAPE sends a step that dense as DDP "
            "does (the whole gradient; its values with their indices would be more). No step is sparse. For SCAPE's "
            f"savings pass a density of at most 0.25, e.g. {density}."
        )
    ramp = config.dense_steps - config.dense_warmup_steps
    why = f"dense_warmup_steps={config.dense_warmup_steps}"
    if ramp:
        why += f", and the first {ramp} of density_ramp_steps={config.density_ramp_steps}, denser than 1/4"
    fitted = _settings(*scaled_schedule(steps), syntax, strategy)
    return (
        f"all sent dense by SCAPE's warm-up ({why}): every step sends the whole gradient, as DDP does, and no step "
        f"is sparse. For a run this short pass a smaller warm-up, e.g. {fitted}."
    )


def scaled_schedule(steps: int) -> tuple[int, int]:
    """(dense_warmup_steps, density_ramp_steps) scaled to a run of ``steps``: a 3% warm-up and a 40% ramp."""
    return max(1, steps * 3 // 100), steps * 2 // 5


def _settings(warmup: int, ramp: int, syntax: Syntax, strategy: str) -> str:
    if syntax == "cli":
        return f"--scape.dense_warmup_steps {warmup} --scape.density_ramp_steps {ramp}"
    return f"{strategy}(dense_warmup_steps={warmup}, density_ramp_steps={ramp})"


def _misfit(
    config: ScapeConfig, steps: int, layout: Sequence[Bucket], world_size: int, syntax: Syntax, strategy: str
) -> str:
    """What is wrong with ``config``'s schedule for a run of ``steps`` (empty: nothing), and a schedule that fits."""
    sent, ddp = run_bytes(layout, config, world_size, steps)
    if not ddp:
        return ""
    ramp_end = config.dense_warmup_steps + config.density_ramp_steps if config.dense_warmup_steps else 0
    inside_ramp = steps < ramp_end
    # A schedule the user chose is questioned only when the run ends inside it; the default one also when it
    # costs more than a quarter of DDP's bytes.
    default = (config.dense_warmup_steps, config.density_ramp_steps) == _DEFAULT_SCHEDULE
    if not inside_ramp and not (default and sent > MAX_FRACTION_OF_DDP * ddp):
        return ""
    warmup, ramp = scaled_schedule(steps)
    if (warmup, ramp) == (config.dense_warmup_steps, config.density_ramp_steps):
        return ""  # already the schedule this notice would suggest
    fitted, _ = run_bytes(layout, config.replace(dense_warmup_steps=warmup, density_ramp_steps=ramp), world_size, steps)
    where = f"ends inside SCAPE's density ramp (step {ramp_end}) and " if inside_ramp else ""
    return (
        f"this run has {steps} optimizer steps: with dense_warmup_steps={config.dense_warmup_steps} and "
        f"density_ramp_steps={config.density_ramp_steps} it {where}sends {sent / ddp:.0%} of DDP's bytes "
        f"({sent / 1e6:,.1f} MB against {ddp / 1e6:,.1f} MB per rank; the first {config.dense_steps} steps dense). "
        f"A schedule scaled to the run (a 3% warm-up, a 40% ramp) sends {fitted / ddp:.0%}: "
        f"{_settings(warmup, ramp, syntax, strategy)}. Its loss may differ: docs/lightning.md says what was measured."
    )


@rank_zero_only
def _print_rank_zero(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def call_at_exit(method: Callable[[], None]) -> None:
    """Call the bound ``method`` when the interpreter exits, unless its object is gone by then."""
    atexit.register(_call_if_alive, weakref.WeakMethod(method))


def _call_if_alive(ref: weakref.WeakMethod[Callable[[], None]]) -> None:
    method = ref()
    if method is not None:
        method()
