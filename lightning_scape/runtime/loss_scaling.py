"""fp16 loss scaling: the engine divides the scale out and skips non-finite steps; the scaler learns the verdict."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_scape.runtime.optimizer import ScapeOptimizer

if TYPE_CHECKING:
    from torch.amp import GradScaler


def grad_scaler_of(precision: Any) -> GradScaler | None:
    """The precision plugin's enabled ``GradScaler`` (fp16 mixed precision), if any."""
    scaler = getattr(precision, "scaler", None)
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return None
    return scaler


class _FoundInf:
    """A stand-in "optimizer" whose one gradient tells ``GradScaler.unscale_`` whether the step was skipped."""

    def __init__(self, skipped: bool, device: torch.device) -> None:
        p = torch.zeros(1, device=device)
        p.grad = torch.full((1,), float("inf") if skipped else 0.0, device=device)
        self.param_groups = [{"params": [p]}]


def report_step_to_scaler(scaler: GradScaler, optimizer: ScapeOptimizer) -> None:
    """Update ``scaler`` as if it had stepped ``optimizer``: back off when the engine skipped the step.

    The engine already unscaled the gradients and agreed across ranks on skipping; the scaler's own
    ``unscale_``/``step`` would touch gradients that were sent already, so it only sees the verdict.
    """
    device = optimizer.engine.buckets[0].params.device
    scaler.unscale_(_FoundInf(optimizer.engine.last_step_skipped, device))  # type: ignore[arg-type,unused-ignore]
    scaler.update()
