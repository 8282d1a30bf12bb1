"""Set-ups that would train badly or communicate nothing: low-precision weights and several optimizers refused, one
process named."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from lightning_scape.warnings import OneProcessWarning

# Lightning's precisions that keep the weights, and so the engine's residual and AdamS's state, in 16 bits.
LOW_PRECISIONS = ("bf16-true", "16-true")


def refuse_low_precision(plugin: Any) -> None:
    """Raise ``ValueError`` for ``precision="bf16-true"`` or ``"16-true"``, saying what to use instead.

    The engine keeps the error-feedback residual and AdamS's state in the parameters' dtype: with 16-bit
    weights the residual loses the small gradients it exists to carry, and the moments round away.

    Args:
        plugin: The strategy's precision plugin (its ``precision`` attribute names the setting).
    """
    precision = getattr(plugin, "precision", None)
    if precision in LOW_PRECISIONS:
        mixed = "bf16-mixed" if precision == "bf16-true" else "16-mixed"
        raise ValueError(
            f"ScapeStrategy does not train in precision={precision!r}: the error-feedback residual and AdamS's "
            f"moments would be kept in 16 bits and lose the small gradients SCAPE carries over. Use "
            f"precision={mixed!r} (16-bit compute, 32-bit weights and optimizer state) or '32-true'."
        )


def the_one_optimizer(strategy: str, optimizers: Sequence[Optimizer], given: str) -> Optimizer:
    """The one optimizer a SCAPE strategy steps; ``ValueError`` for none or several, saying what to do instead.

    Args:
        strategy: The strategy's class name, for the message.
        optimizers: What the user handed over.
        given: How they came, for the message (``"fabric.setup was given"``, ``"configure_optimizers returned"``).

    Returns:
        The optimizer.
    """
    if len(optimizers) == 1:
        return optimizers[0]
    names = ", ".join(type(opt).__name__ for opt in optimizers) or "none"
    raise ValueError(
        f"{strategy} steps one optimizer per model, but {given} {len(optimizers)} ({names}): SCAPE "
        "synchronises the gradients inside that one optimizer's step. Put all parameters in param groups of one "
        "AdamS / AdamW (a group per learning rate), or use Lightning's own DDP / FSDP strategy for several optimizers."
    )


def warn_if_one_process(world_size: int, interface: str) -> None:
    """Warn (rank 0) that a run of one process communicates nothing, and what to pass instead.

    Args:
        world_size: The number of processes of the run.
        interface: ``"Trainer"`` or ``"Fabric"``, for the message.
    """
    if world_size != 1:
        return
    rank_zero_warn(
        f"lightning_scape: ScapeStrategy is running one process (devices=1 on one node): it communicates nothing, "
        f"so the run is plain AdamS training and shows nothing of SCAPE. Pass {interface}(devices=2, ...) or more "
        f"devices or nodes (on the CPU, devices=2 starts two processes), or strategy='auto' for a single-process "
        "run; to study SCAPE's updates in one process, use lightning_scape.simulate.",
        category=OneProcessWarning,
    )
