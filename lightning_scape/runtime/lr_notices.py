"""What a converted optimizer is told about its learning rate (:class:`ConvertedLrNotices`): once when it exceeds
the rate at which converted AdamW trained as AdamW did, and once when it has not changed for a while.

Both come from one fact (``docs/algorithm.md`` section 2): AdamS moves each coordinate by about lr per step even
where its gradient is mostly noise, where AdamW's steps shrink, so at the same rate it steps further, and keeps
doing so until the rate decays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn

# The highest learning rate at which a converted AdamW matched or beat AdamW on every model measured
# (docs/algorithm.md section 2); above it, the first step that uses such a rate is preceded by a warning.
CONVERTED_LR_CEILING = 1e-3
# Steps after which a learning rate that never changed is taken for a constant one: past the default dense warm-up
# and density ramp (430 steps), where the steps of a constant rate measured worse than AdamW's.
CONSTANT_LR_STEPS = 500


class ConvertedLrNotices:
    """The learning-rate notices of one converted optimizer (AdamW or Adam stepped as AdamS), each said once on
    rank 0; an optimizer the user chose as AdamS is told nothing.

    Args:
        name: The converted optimizer's class name, for the messages.
        converted: False when the user's optimizer is AdamS itself.
    """

    def __init__(self, name: str, converted: bool) -> None:
        self.name = name
        self.ceiling_told = self.constant_told = not converted
        self.steps = 0
        self.first_lrs: list[float] | None = None

    def before_step(self, param_groups: Sequence[dict[str, Any]]) -> None:
        """Check the rates the next step will use (an LR scheduler's warm-up may cross the ceiling later)."""
        if self.ceiling_told and self.constant_told:
            return
        lrs = [float(g["lr"]) for g in param_groups]
        if not self.ceiling_told:
            self._above_ceiling(lrs)
        if not self.constant_told:
            self._constant(lrs)
        self.steps += 1

    def _above_ceiling(self, lrs: list[float]) -> None:
        lr, i = max((lr, i) for i, lr in enumerate(lrs))
        if lr <= CONVERTED_LR_CEILING:
            return
        self.ceiling_told = True
        name = self.name
        rank_zero_warn(
            f"lightning_scape: lr={lr:g} (param group {i}) is above {CONVERTED_LR_CEILING:g}, the highest learning "
            f"rate at which the {name} that SCAPE converted to AdamS trained as well as under DDP on every model "
            f"measured. AdamS moves each coordinate by about lr per step even where its gradient is mostly noise, "
            f"where {name}'s steps shrink, so it steps further at the same lr: at 3e-3 those models ended 15-50% "
            f"worse than with {name}, and a CNN did not train without a learning-rate warm-up (docs/algorithm.md "
            f"section 2). Use lr={CONVERTED_LR_CEILING:g} (or about half the lr tuned for {name}) and a warm-up."
        )

    def no_scheduler(self) -> None:
        """Before the first step, where the loop has no learning-rate scheduler (the Trainer knows it at set-up):
        say now what :meth:`_constant` would say after :data:`CONSTANT_LR_STEPS` steps, and not again."""
        if self.constant_told:
            return
        self.constant_told = True
        rank_zero_warn(
            "lightning_scape: configure_optimizers returned no learning-rate scheduler, so the rate stays constant. "
            f"{_constant_rate_advice(self.name)} If the training step changes the rate itself, ignore this."
        )

    def _constant(self, lrs: list[float]) -> None:
        if self.first_lrs is None or len(lrs) != len(self.first_lrs):  # the first step, or a param group added
            self.first_lrs, self.steps = lrs, 0
            return
        if lrs != self.first_lrs:  # a scheduler (or the loop) changes it: nothing to say
            self.constant_told = True
            return
        if self.steps < CONSTANT_LR_STEPS:
            return
        self.constant_told = True
        rank_zero_warn(
            f"lightning_scape: the learning rate has not changed in {CONSTANT_LR_STEPS} steps. "
            f"{_constant_rate_advice(self.name)} A scheduler that lowers it later (once an epoch, say) already does."
        )


def _constant_rate_advice(name: str) -> str:
    """What a constant rate does to a converted ``name`` (measured), and what to do."""
    return (
        f"AdamS, which SCAPE converted your {name} to, keeps moving each coordinate by about lr per step where "
        f"{name}'s steps shrink: at a constant rate a small CNN and an MLP ended up to 31% above {name}'s loss after "
        f"600 steps (as did AdamS with every step sent: up to 34%), while with a decaying rate every model measured "
        f"ended within 5% of it or below (docs/benchmarks.md, 'AdamW converted to AdamS'). Decay the learning rate "
        f"towards the end of training (e.g. torch.optim.lr_scheduler.CosineAnnealingLR), or lower it."
    )
